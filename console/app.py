"""The console's web application: server-rendered pages, the same routes as JSON.

Every page answers JSON too, to ``Accept: application/json`` or ``?format=json``: scripts
use the routes the pages use. Reads and actions are blocking library calls, run in a thread
each. What an operator does is a POST that needs the operator role and, from a form, the
page's CSRF token (a JSON body needs none: no other site's page can send one here, as this
application allows no cross-origin requests).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from console import actions, reads
from console.auth import ANONYMOUS, User, Users, csrf_ok, csrf_token
from console.live import Live
from console.run_events import RunStreams, page_json, position, read_page
from console.settings import ConsoleSettings
from consumers.deadletter import KafkaSender
from consumers.settings import ConsumerSettings
from outbox.db.dsn import sqlalchemy_url
from outbox.db.engines import engine_for
from outbox.db.schema import translate
from outbox.errors import ConfigurationError, OutboxError, RunNotFound
from outbox.kafka.api import Admin
from outbox.runs.events import MAX_LIMIT
from outbox.runs.states import FINISHED, RunState
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
# How often the consumers' lag is asked of Kafka (the overview refreshes more often), and
# after a failed read (each rebuilds the admin client, which costs a broker time to answer).
LAG_SECONDS = 10.0
LAG_RETRY_SECONDS = 60.0
# How the console's connections are named in pg_stat_activity.
APPLICATION_NAME = "outboxkit-console"
# The relays' lane lease (relay settings' default): a relay silent for longer is shown dead.
RELAY_LEASE_SECONDS = 10.0
FAILURE_STATUSES = ("dead-lettered", "retrying", "replayed", "discarded", "recovered")
SECURITY_HEADERS = {
    # Only this console's own files: no inline script, no other origin, no framing.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


class Console:
    """The application's state: one engine, the users, the templates, the live counts."""

    def __init__(self, settings: ConsoleSettings, outbox: OutboxSettings) -> None:
        url = settings.resolved_database_url()
        if not url:
            raise ConfigurationError("no database: set OUTBOXKIT_CONSOLE_DATABASE_URL or "
                                     "OUTBOXKIT_DATABASE_URL (or pass --database-url)")
        self.settings, self.outbox = settings, outbox
        self.database = where(url)
        # jit off: PostgreSQL compiles a statement whose estimated cost is high (a count
        # over a big table), ~200-300 ms here, for reads that then take a few ms.
        self.engine: Engine = engine_for(
            sqlalchemy_url(url),
            connect={"options": "-c jit=off", "application_name": APPLICATION_NAME}, pool_size=4,
            max_overflow=4, pool_pre_ping=True,
            execution_options={"schema_translate_map": translate(outbox)})
        self.users = Users(settings.users.get_secret_value())
        self.secret = settings.secret_key.get_secret_value()
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.filters["pretty"] = _pretty
        self.templates.env.filters["ago"] = _ago
        self.templates.env.filters["at"] = _at
        self.live = Live(self._overview, settings.refresh_seconds)
        self.run_streams = RunStreams(self.engine, outbox)
        self._kafka_lock = threading.Lock()  # one read of Kafka at a time (one admin client)
        self._admin: Admin | None = None
        self._lag_cache: tuple[float, list[dict[str, Any]] | None, str | None] | None = None

    def end_streams(self) -> None:
        """End every open stream, the overview's and the runs' (the server is stopping: a
        stream never ends by itself, and the server waits for its requests)."""
        self.live.end_streams()
        self.run_streams.end_streams()

    def _overview(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            found = reads.overview(conn, self.outbox,
                                   lease_seconds=RELAY_LEASE_SECONDS).as_dict()
        found["consumers"], found["consumers_error"] = self._lag()
        return found

    def _lag(self) -> tuple[list[dict[str, Any]] | None, str | None]:
        """The groups' lag as last read from Kafka; never waits for Kafka. A read older than
        LAG_SECONDS (LAG_RETRY_SECONDS after a failure) starts a new one in a thread of its
        own, which the next overview shows: a broker that does not answer (a first contact
        can take kafka-python 30 s) never holds the page or its live stream."""
        if not self.settings.resolved_bootstrap():
            return None, "no Kafka configured (OUTBOXKIT_KAFKA_BOOTSTRAP)"
        cached = self._lag_cache
        wait = LAG_RETRY_SECONDS if cached is not None and cached[2] else LAG_SECONDS
        if (cached is None or time.monotonic() - cached[0] >= wait) \
                and self._kafka_lock.acquire(blocking=False):
            threading.Thread(target=self._read_lag, name="console-lag", daemon=True).start()
        if cached is None:
            return None, "reading the groups from Kafka…"
        return cached[1], cached[2]

    def _read_lag(self) -> None:
        lag: list[dict[str, Any]] | None = None
        error: str | None = "Kafka did not answer"
        try:
            if self._admin is None:
                backend = ConsumerSettings(
                    kafka_bootstrap=self.settings.resolved_bootstrap()).kafka()
                self._admin = backend.admin("outbox-console", request_timeout_ms=5_000)
            lag, error = [g.as_dict() for g in reads.consumer_lag(self._admin)], None
        except Exception as exc:
            # A background reader reports, never dies: besides KafkaClientError and OSError,
            # kafka-python raises RuntimeError when its transport is closed under it (the
            # console shutting down while a read is in flight).
            error = f"Kafka did not answer: {first_line(exc)}"
            self._close_admin()
        finally:
            # Stamped when the read ended: a slow failure is not retried at once.
            self._lag_cache = (time.monotonic(), lag, error)
            self._kafka_lock.release()

    def _close_admin(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None

    def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """*fn*(conn, ...) on a connection of its own, in a thread."""
        def go() -> Any:
            with self.engine.connect() as conn:
                return fn(conn, *args, **kwargs)
        return run_in_threadpool(go)

    def page(self, request: Request, user: User, name: str, code: int = 200,
             **context: Any) -> Response:
        context.update(user=user, csrf=csrf_token(self.secret, user) if user.can_act
                       else "", said=request.query_params.get("said"),
                       database=self.database, path=request.url.path,
                       signing_in=self.users.any)
        return self.templates.TemplateResponse(request, name, context, status_code=code)

    def failed(self, request: Request, user: User, status: int, message: str) -> Response:
        if wants_json(request):
            return _json({"error": message}, status)
        return self.page(request, user, "error.html", status, message=message, status=status)

    def view(self, handler: Callable[[Request, User], Awaitable[Response]]
             ) -> Callable[[Request], Awaitable[Response]]:
        """*handler* for a signed-in user; the library's refusals as pages (or JSON)."""
        console = self
        async def endpoint(request: Request) -> Response:
            user = await run_in_threadpool(console.who, request)
            if user is None:
                return Response("sign in (HTTP basic auth)", status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="outboxkit console"'})
            try:
                response = await handler(request, user)
            except (actions.BadInput, reads.BadCursor, ValueError) as exc:
                response = console.failed(request, user, 400, str(exc))
            except RunNotFound as exc:
                response = console.failed(request, user, 404, str(exc))
            except OutboxError as exc:  # refused by the library: nothing was written
                response = console.failed(request, user, 409, str(exc))
            except PoolTimeout:
                response = console.failed(request, user, 503, "the console's connections to "
                                          "the database are all busy: try again")
            except DBAPIError as exc:  # rolled back: nothing was written either
                log.warning("console: %s %s failed in the database: %s", request.method,
                            request.url.path, exc.orig, extra={"event": "console.db_error"})
                status = 503 if exc.connection_invalidated else 500
                first = str(exc.orig).splitlines()[0] if exc.orig else type(exc).__name__
                response = console.failed(request, user, status,
                                          f"the database refused or did not answer: {first}")
            response.headers.update(SECURITY_HEADERS)
            return response
        return endpoint

    def act(self, handler: Callable[[Request, User, dict[str, Any]], Awaitable[str]]
            ) -> Callable[[Request], Awaitable[Response]]:
        """*handler* for an operator (CSRF-checked from a form); then back to the page."""
        console = self
        async def acting(request: Request, user: User) -> Response:
            if not user.can_act:
                why = ("this user may only read" if console.users.any else
                       "no operator is configured (OUTBOXKIT_CONSOLE_USERS): the console "
                       "is read-only")
                return console.failed(request, user, 403, why)
            if request.headers.get("content-type", "").startswith("application/json"):
                try:
                    body = await request.json()
                except ValueError as exc:
                    raise actions.BadInput(f"the body is not JSON: {exc}") from exc
                if not isinstance(body, dict):
                    raise actions.BadInput("the body must be a JSON object")
                body = _fields(body)
            else:
                form = await request.form()
                body = {k: form.getlist(k) if k == "id" else form.get(k) for k in form}
                if any(not isinstance(v, str | list) for v in body.values()) or any(
                        not isinstance(i, str) for i in body.get("id") or []):
                    raise actions.BadInput("a form's fields are text (no file uploads)")
                if not csrf_ok(console.secret, user, body.get("csrf")):
                    return console.failed(request, user, 403, "the form's CSRF token is missing or "
                                  "wrong: reload the page and try again")
            said = await handler(request, user, body)
            # Each action in the log too, with who did it (the rows say so where they can).
            log.info("console: %s %s by %s: %s", request.method, request.url.path, user.name,
                     said, extra={"event": "console.action", "actor": user.name})
            if wants_json(request) or "csrf" not in body:
                return _json({"ok": True, "said": said})
            back = _same_site(body.get("next"), "/")
            glue = "&" if "?" in back else "?"
            return RedirectResponse(f"{back}{glue}said={quote(said)}", status_code=303)
        return self.view(acting)

    def kafka_sender(self) -> KafkaSender:
        """A producer for one replay (TLS/SASL as the consumers': OUTBOXKIT_CONSUMER_*)."""
        bootstrap = self.settings.resolved_bootstrap()
        if not bootstrap:
            raise ConfigurationError("no Kafka to replay to: set OUTBOXKIT_KAFKA_BOOTSTRAP")
        backend = ConsumerSettings(kafka_bootstrap=bootstrap).kafka()
        return KafkaSender(backend, client_id="outbox-console-replay", timeout_s=15.0)

    def who(self, request: Request) -> User | None:
        """The signed-in user (``None``: wrong or missing credentials while users exist)."""
        if not self.users.any:
            return ANONYMOUS
        return self.users.check(request.headers.get("authorization"))


def where(url: str) -> str:
    """Host, port and database of *url*, nothing else: a password may hide in the query
    (``?password=``) or in a key=value string, where redaction of the user part misses it."""
    if "://" not in url:
        found = dict(part.split("=", 1) for part in url.split() if "=" in part)
        return f"{found.get('host', '?')}:{found.get('port', '5432')}/{found.get('dbname', '?')}"
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{host}:{parts.port or 5432}{parts.path or '/'}"


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def _at(when: datetime | None) -> str:
    """To the second, in UTC: the page's times line up with the database's and the logs'."""
    return "-" if when is None else when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _ago(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = (datetime.now(UTC) - when).total_seconds()
    future = seconds < 0
    seconds = abs(seconds)
    text = (f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
            if seconds < 7200 else f"{seconds / 3600:.1f} h" if seconds < 172800
            else f"{seconds / 86400:.0f} d")
    return f"in {text}" if future else f"{text} ago"


def wants_json(request: Request) -> bool:
    """A script, not a page: asked for JSON, or sent it."""
    return (request.query_params.get("format") == "json"
            or request.headers.get("accept", "").startswith("application/json")
            or request.headers.get("content-type", "").startswith("application/json"))


def _json(value: Any, status: int = 200) -> Response:
    return Response(json.dumps(value, default=_plain, indent=2), status_code=status,
                    media_type="application/json")


def _plain(value: Any) -> Any:
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return str(value)


def _uuid(raw: str, what: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError as exc:
        raise actions.BadInput(f"{raw[:60]!r} is not a {what} id (a UUID)") from exc


def _fields(body: dict[str, Any]) -> dict[str, Any]:
    """A JSON body's fields as the actions take them: text, except ``ids`` (whole numbers)
    and ``force`` (true/false); evidence may be given as an object (stored as its JSON)."""
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name == "evidence" and isinstance(value, dict):
            out[name] = json.dumps(value)
        elif name in ("ids", "id"):
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, int | str) and not isinstance(v, bool) for v in values):
                raise actions.BadInput("ids are the refused rows' ids (whole numbers)")
            out[name] = values
        elif name == "force":
            if not isinstance(value, bool):
                raise actions.BadInput("force is true or false")
            out[name] = value
        elif value is None or isinstance(value, str):
            out[name] = value
        else:
            raise actions.BadInput(f"{name} must be text, not {type(value).__name__}")
    return out


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return 100
    if not raw.isdigit() or not 0 < int(raw) <= MAX_LIMIT:
        raise actions.BadInput(f"limit is a whole number from 1 to {MAX_LIMIT}")
    return int(raw)


def _failure_id(request: Request) -> int:
    try:
        return int(request.path_params["failure_id"])
    except ValueError as exc:
        raise actions.BadInput("a failure id is a whole number") from exc


def _same_site(target: str | None, fallback: str) -> str:
    """Where to go after a form: a path of this console, never another site."""
    if (not target or not target.startswith("/") or target.startswith("//")
            or "\\" in target or any(ord(c) < 32 for c in target)):
        return fallback  # a browser reads "/\\host" as "//host": another site
    parts = urlsplit(target)
    return fallback if parts.scheme or parts.netloc else target


async def run_events(request: Request, user: User) -> Response:
    """The run's events after ``Last-Event-ID`` (or ``?after=``): server-sent events as
    they commit, or one page of them as JSON (``?limit=``, at most MAX_LIMIT)."""
    console: Console = request.app.state.console
    run_id = _uuid(request.path_params["run_id"], "run")
    after = position(request.headers.get("last-event-id"),
                     request.query_params.get("after"))
    if wants_json(request):
        limit = _limit(request.query_params.get("limit"))
        state, found = await console.read(read_page, run_id, after, limit, console.outbox)
        return _json(page_json(run_id, state, found, after))
    state, found = await console.read(read_page, run_id, after, 1, console.outbox)
    if state in FINISHED and not found:
        return Response(status_code=204)  # all sent: a browser does not reconnect
    refused = console.run_streams.refused(user.name)
    if refused is not None:
        return console.failed(request, user, 503, f"{refused}: close one and try again, or "
                              "read them as JSON (?format=json)")
    return StreamingResponse(console.run_streams.stream(run_id, after, user=user.name),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-store"})


def create_app(settings: ConsoleSettings | None = None,
               outbox: OutboxSettings | None = None) -> Starlette:
    """The console as an ASGI application (serve it with uvicorn, or ``outbox console``)."""
    console = Console(settings or ConsoleSettings(), outbox or OutboxSettings())

    # --- pages --------------------------------------------------------------------------
    async def overview(request: Request, user: User) -> Response:
        data = await run_in_threadpool(console._overview)
        if wants_json(request):
            return _json(data)
        return console.page(request, user, "overview.html", o=data)

    async def events(request: Request, user: User) -> Response:
        return StreamingResponse(console.live.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    async def runs(request: Request, user: User) -> Response:
        q = request.query_params
        state = q.get("state") or None
        if state is not None and state not in {s.value for s in RunState}:
            raise actions.BadInput(f"state {state!r} is not one of "
                                   f"{', '.join(s.value for s in RunState)}")
        found = await console.read(reads.runs_page, state=state,
                                   workflow=q.get("workflow") or None,
                                   version=q.get("version") or None, age=q.get("age") or None,
                                   search=q.get("q") or None, before=q.get("before") or None,
                                   limit=console.settings.page_size)
        if wants_json(request):
            return _json({"runs": found.runs, "next": found.next_cursor})
        return console.page(request, user, "runs.html", found=found, q=q,
                            states=list(RunState), ages=list(reads.AGES))

    async def run(request: Request, user: User) -> Response:
        run_id = _uuid(request.path_params["run_id"], "run")
        found = await console.read(reads.run_page, run_id, console.outbox)
        if wants_json(request):
            return _json(found)
        return console.page(request, user, "run.html", r=found, run=found.view.run)

    async def inbox(request: Request, user: User) -> Response:
        found = await console.read(reads.inbox, console.outbox,
                                   limit=console.settings.page_size)
        if wants_json(request):
            return _json(found)
        return console.page(request, user, "inbox.html", i=found, now=datetime.now(UTC))

    async def messages(request: Request, user: User) -> Response:
        status = request.query_params.get("failures") or "dead-lettered"
        if status not in FAILURE_STATUSES:
            raise actions.BadInput(f"failures {status!r} is not one of "
                                   f"{', '.join(FAILURE_STATUSES)}")
        found = await console.read(reads.messages_page, console.outbox, failures=status,
                                   limit=console.settings.page_size)
        if wants_json(request):
            return _json(found)
        return console.page(request, user, "messages.html", m=found, failures=status,
                    statuses=FAILURE_STATUSES)

    # --- actions ------------------------------------------------------------------------
    def blocking(fn: Callable[..., str], *args: Any, **kwargs: Any) -> Awaitable[str]:
        return run_in_threadpool(fn, console.engine, console.outbox, *args, **kwargs)

    async def resolve(request: Request, user: User, body: dict[str, Any]) -> str:
        return await blocking(actions.resolve, _uuid(request.path_params["op_id"], "operation"),
                              outcome=str(body.get("outcome") or ""),
                              evidence=body.get("evidence"), reason=body.get("reason"),
                              actor=user.name)

    async def grant(request: Request, user: User, body: dict[str, Any]) -> str:
        return await blocking(actions.grant_approval,
                              _uuid(request.path_params["approval_id"], "approval"),
                              reason=body.get("reason"), digest=body.get("digest"),
                              actor=user.name)

    async def revoke(request: Request, user: User, body: dict[str, Any]) -> str:
        return await blocking(actions.revoke_approval,
                              _uuid(request.path_params["approval_id"], "approval"),
                              reason=body.get("reason"), actor=user.name)

    async def requeue(request: Request, user: User, body: dict[str, Any]) -> str:
        return await blocking(actions.requeue_run, _uuid(request.path_params["run_id"], "run"),
                              reason=body.get("reason"),
                              force=body.get("force") in (True, "on", "true", "1"),
                              actor=user.name)

    async def cancel(request: Request, user: User, body: dict[str, Any]) -> str:
        return await blocking(actions.cancel_run, _uuid(request.path_params["run_id"], "run"),
                              reason=body.get("reason"), actor=user.name)

    async def replay(request: Request, user: User, body: dict[str, Any]) -> str:
        return await blocking(actions.replay, _failure_id(request),
                              kafka=console.kafka_sender, actor=user.name)

    async def discard(request: Request, user: User, body: dict[str, Any]) -> str:
        return await blocking(actions.discard_failure, _failure_id(request),
                              reason=body.get("reason"), actor=user.name)

    async def retry(request: Request, user: User, body: dict[str, Any]) -> str:
        ids = body.get("id") or body.get("ids") or []
        return await blocking(actions.retry, ids if isinstance(ids, list) else [ids])

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        yield
        await console.live.close()
        console._close_admin()
        console.engine.dispose()

    hosts = [h.strip() for h in console.settings.allowed_hosts.split(",") if h.strip()]
    if console.settings.host not in ("0.0.0.0", "::", ""):  # noqa: S104
        hosts.append(console.settings.host)
    app = Starlette(middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)],
                    routes=[
        Route("/", console.view(overview)),
        Route("/events", console.view(events)),
        Route("/runs", console.view(runs)),
        Route("/runs/{run_id}", console.view(run)),
        Route("/runs/{run_id}/events", console.view(run_events)),
        Route("/runs/{run_id}/requeue", console.act(requeue), methods=["POST"]),
        Route("/runs/{run_id}/cancel", console.act(cancel), methods=["POST"]),
        Route("/inbox", console.view(inbox)),
        Route("/operations/{op_id}/resolve", console.act(resolve), methods=["POST"]),
        Route("/approvals/{approval_id}/grant", console.act(grant), methods=["POST"]),
        Route("/approvals/{approval_id}/revoke", console.act(revoke), methods=["POST"]),
        Route("/messages", console.view(messages)),
        Route("/messages/retry", console.act(retry), methods=["POST"]),
        Route("/failures/{failure_id}/replay", console.act(replay), methods=["POST"]),
        Route("/failures/{failure_id}/discard", console.act(discard), methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ], lifespan=lifespan)
    app.state.console = console
    return app
