"""A bound on how long an outboxkit daemon waits for PostgreSQL to answer.

TCP keepalives and ``tcp_user_timeout`` find a server that vanished (nothing acknowledges
what is sent). They cannot find one that hangs, or a middlebox that keeps the connection
but stops forwarding (a hung pooler, a proxy, a load balancer): the bytes are acknowledged
and the answer never comes. libpq has no timeout for that, so a daemon's call would wait
forever, holding its Kafka partitions, its lanes or its runs while looking alive (the
network fault harness's half-open PostgreSQL scenario showed each daemon waiting the whole
60 s it lasted).

Here every round trip of a daemon's connection (a statement, a fetch, a commit) waits at
most ``answer_timeout_s``: psycopg's own wait takes the bound, and when it passes the
connection is closed (its state is unknown: the statement may have run, the commit may
have happened) and :class:`NoAnswer`, an ``OperationalError``, is raised. SQLAlchemy sees a
closed connection and drops it from its pool; the daemon's ordinary failure path (back off,
reconnect, retry under its leases and dedup marks) takes over. A wait that sets its own
timeout (``notifies(timeout=...)``) keeps it.

The bound must be longer than any statement the daemon may legitimately wait for, lock
waits included: it is the daemons' setting ``database_answer_timeout_seconds`` (60 s; 0:
none), and the server's ``statement_timeout`` / ``lock_timeout``, if set, should be lower.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors
from psycopg.rows import TupleRow

# psycopg's own polling interval inside a wait (its module's _WAIT_INTERVAL), kept as is.
INTERVAL_S = 0.1


class NoAnswer(psycopg.OperationalError):
    """PostgreSQL did not answer within the bound; the connection was closed."""


def _no_answer(pgconn: Any, seconds: float) -> NoAnswer:
    pgconn.finish()  # its state is unknown: nothing may use it again
    return NoAnswer(f"PostgreSQL did not answer within {seconds:g} s "
                    "(database_answer_timeout_seconds); the connection was closed, and what "
                    "it was doing may or may not have happened")


class BoundedConnection(psycopg.Connection[TupleRow]):
    """A psycopg connection whose waits for an answer end after ``answer_timeout_s``."""

    answer_timeout_s: float | None = None

    def wait(self, gen: Any, interval: float = INTERVAL_S, timeout: float | None = None) -> Any:
        bound = self.answer_timeout_s
        if timeout is not None or not bound:
            return super().wait(gen, interval, timeout)
        try:
            return super().wait(gen, interval, bound)
        except errors._WaitTimeout:
            raise _no_answer(self.pgconn, bound) from None


class BoundedAsyncConnection(psycopg.AsyncConnection[TupleRow]):
    """:class:`BoundedConnection` for asyncio."""

    answer_timeout_s: float | None = None

    async def wait(self, gen: Any, interval: float = INTERVAL_S,
                   timeout: float | None = None) -> Any:
        bound = self.answer_timeout_s
        if timeout is not None or not bound:
            return await super().wait(gen, interval, timeout)
        try:
            return await super().wait(gen, interval, bound)
        except errors._WaitTimeout:
            raise _no_answer(self.pgconn, bound) from None


def connector(url: str, answer_timeout_s: float, **connect: Any) -> Any:
    """A ``creator`` for :func:`sqlalchemy.create_engine`: bounded connections to *url*."""

    def connect_bounded() -> BoundedConnection:
        conn = BoundedConnection.connect(url, **connect)
        conn.answer_timeout_s = answer_timeout_s
        return conn

    return connect_bounded


def async_connector(url: str, answer_timeout_s: float, **connect: Any) -> Any:
    """An ``async_creator`` for :func:`sqlalchemy.ext.asyncio.create_async_engine`."""

    async def connect_bounded() -> BoundedAsyncConnection:
        conn = await BoundedAsyncConnection.connect(url, **connect)
        conn.answer_timeout_s = answer_timeout_s
        return conn

    return connect_bounded
