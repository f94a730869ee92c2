"""A primary that hangs (or vanished without a TCP reset) listed first in a failover URL:
outboxkit's own connections give up on it after ``connect_timeout`` and reach the next host.

libpq's own default is to wait for the first host's answer as long as TCP does: forever
for a server that accepted the connection and never answers, which is what the listening
socket below does (the kernel completes the handshake; no one reads)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from sqlalchemy import text

from outbox.db.dsn import CONNECT_DEFAULTS
from outbox.db.engines import engine_for
from tests.integration.cli_support import Ran, outbox

TIMEOUT_S = CONNECT_DEFAULTS["connect_timeout"]


@pytest.fixture
def silent_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def hung_first(database_url: str, port: int) -> str:
    """*database_url* with the silent host before its own, as a primary then its standby."""
    parts = urlsplit(database_url)
    userinfo, at, host = parts.netloc.rpartition("@")
    netloc = f"{userinfo}{at}127.0.0.1:{port},{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def timed(action: Callable[[], object], bound_s: float) -> float:
    """Seconds *action* took; fails if it is still waiting after *bound_s*."""
    done: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        started = time.monotonic()
        try:
            action()
            done.append(time.monotonic() - started)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not errors, errors
    assert done, f"still waiting on the hung host after {bound_s} s"
    return done[0]


def test_an_engine_passes_over_a_hung_first_host(database_url: str, silent_port: int) -> None:
    url = hung_first(database_url, silent_port)
    engine = engine_for(url)  # what the relay, the consumers and the CLI connect with

    def query() -> None:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1

    try:
        took = timed(query, bound_s=TIMEOUT_S * 4)
    finally:
        engine.dispose()
    # It waited on the hung host for connect_timeout, then the next host answered.
    assert TIMEOUT_S - 0.5 <= took <= TIMEOUT_S * 3, took


def test_the_command_line_passes_over_a_hung_first_host(
    database_url: str, silent_port: int
) -> None:
    url = hung_first(database_url, silent_port)
    ran: list[Ran] = []
    took = timed(lambda: ran.append(outbox("status", "--database-url", url)), TIMEOUT_S * 4)
    assert ran[0].returncode == 0, (ran[0].stdout, ran[0].stderr)
    assert took >= TIMEOUT_S - 0.5

