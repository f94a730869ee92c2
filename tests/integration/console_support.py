"""The console served by a real uvicorn in a thread of the test, and plain HTTP to it."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from sqlalchemy import Engine, text

from console import ConsoleSettings, create_app
from console.auth import hash_password
from dedup.ledger import Ledger
from tests.integration.operations_support import waiting_run

PASSWORDS = {"olga": "operator-pw", "vic": "viewer-pw"}
USERS = (f"olga:operator:{hash_password(PASSWORDS['olga'])},"
         f"vic:viewer:{hash_password(PASSWORDS['vic'])}")
LEDGER = Ledger()


@contextmanager
def serving(database_url: str, **settings: Any) -> Iterator[str]:
    """The console on 127.0.0.1, a free port; its base URL while it runs."""
    values = {"database_url": database_url, "users": USERS, "refresh_seconds": 0.5, **settings}
    app = create_app(ConsoleSettings(**values))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive(), "the console did not start"
        assert time.monotonic() < deadline, "the console did not start in 20 s"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        assert not thread.is_alive(), "the console did not stop"


@dataclass
class Answer:
    status: int
    body: str
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


OPENER = urllib.request.build_opener(NoRedirect)


def call(base: str, path: str, *, user: str | None = "olga", form: dict[str, Any] | None = None,
         body: Any = None, as_json: bool = False) -> Answer:
    """GET *path*, or POST *form* (urlencoded) or *body* (JSON), as *user*."""
    headers = {"Accept": "application/json"} if as_json else {}
    if user is not None:
        token = base64.b64encode(f"{user}:{PASSWORDS[user]}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    data = None
    if form is not None:
        data = urllib.parse.urlencode(form, doseq=True).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    elif body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(base + path, data=data, headers=headers)  # noqa: S310 - http://127.0.0.1 only
    try:
        with OPENER.open(request, timeout=20) as response:
            return Answer(response.status, response.read().decode(), dict(response.headers))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read().decode(), dict(exc.headers))


def csrf_of(html: str) -> str:
    marker = 'name="csrf" value="'
    start = html.index(marker) + len(marker)
    return html[start:html.index('"', start)]


def unknown_order(engine: Engine, key: str = "order-1", status: str = "needs-human"
                  ) -> tuple[uuid.UUID, uuid.UUID]:
    """A run waiting on a supplier order whose outcome nobody knows: (run id, operation id)."""
    run_id = waiting_run(engine, key)
    with engine.begin() as conn:
        intent = LEDGER.begin(conn, key=f"place-order:{key}", system="supplier",
                              operation="place-order", request={"item": "widget", "qty": 3},
                              message_id=f"m-{key}", run_id=run_id)
        conn.execute(text("UPDATE outboxkit.operations SET status = :s WHERE id = :i"),
                     {"s": status, "i": intent.operation.id})
    return run_id, intent.operation.id
