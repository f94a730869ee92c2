"""psycopg connections pooled without SQLAlchemy, for a daemon that runs only its own SQL.

The relay runs hand-written statements only (``relay/queries.sql``). SQLAlchemy's Core and
its dialects cost its start-up about 175 ms of imports, a third of the time from spawn to
the first record, and each checkout of its pool about 100 µs of events (the relay kept its
claim's and its record's connections checked out for that), for nothing the relay used.
This pool keeps up to ``size`` idle connections, made as every outboxkit daemon makes them
(:func:`connect_args`, the answer bound of :mod:`outbox.db.answers`). What SQLAlchemy's
pool did for the relay still happens: a connection idle for ``ping_after_idle_s`` is tested
before it is handed out and replaced if the server went away meanwhile; one whose use
failed is closed unless it is idle and sound, so a failed use never hands an unknown state
to the next.

Every connection is in autocommit. :meth:`Pool.connection` runs each statement as its own
transaction (a claim, a one-statement record, a read): no BEGIN and COMMIT round trips.
:meth:`Pool.begin` is one explicit transaction, committed at the end of the block and rolled
back on an error. Rows come as named tuples (``row.lane``); a hot path that reads thousands
asks its cursor for plain tuples.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import namedtuple_row

from outbox.db import answers
from outbox.db.dsn import connect_args, libpq_url

Connection = psycopg.Connection[Any]


class Pool:
    """Connections to one database (*url*, a libpq URL, several hosts included), each used
    by one thread at a time; *connect* adds libpq settings (``options``...)."""

    def __init__(self, url: str, *, size: int = 1, connect: Mapping[str, Any] | None = None,
                 answer_timeout_s: float | None = None,
                 ping_after_idle_s: float | None = None) -> None:
        self._url = libpq_url(url)
        self._args = connect_args(url, **(connect or {}))
        self._answer_timeout_s = answer_timeout_s
        self._ping_after_idle_s = ping_after_idle_s
        self._size = size
        self._idle: list[tuple[Connection, float]] = []  # (connection, idle since)
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connection in autocommit, given back (or closed, if broken) afterwards."""
        conn = self._take()
        try:
            yield conn
        finally:
            self._give_back(conn)

    @contextlib.contextmanager
    def begin(self) -> Iterator[Connection]:
        """A connection inside one transaction: committed at the end, rolled back on error."""
        with self.connection() as conn, conn.transaction():
            yield conn

    def close(self) -> None:
        """Close the idle connections; those in use are closed when given back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def _take(self) -> Connection:
        while True:
            with self._lock:
                if not self._idle:
                    break
                conn, since = self._idle.pop()  # the most recent: the likeliest to be alive
            if conn.broken or conn.closed:
                conn.close()
                continue
            ping_after = self._ping_after_idle_s
            if ping_after is not None and time.monotonic() - since >= ping_after:
                try:
                    conn.execute("SELECT 1")
                except psycopg.Error:  # gone while idle (a restart, a failover): another
                    conn.close()
                    continue
            return conn
        return self._connect()

    def _connect(self) -> Connection:
        if self._answer_timeout_s:
            make = answers.connector(self._url, self._answer_timeout_s, autocommit=True,
                                     row_factory=namedtuple_row, **self._args)
            conn: Connection = make()
            return conn
        return psycopg.Connection.connect(self._url, autocommit=True,
                                          row_factory=namedtuple_row, **self._args)

    def _give_back(self, conn: Connection) -> None:
        if not conn.broken and conn.info.transaction_status == TransactionStatus.IDLE:
            with self._lock:
                if not self._closed and len(self._idle) < self._size:
                    self._idle.append((conn, time.monotonic()))
                    return
        conn.close()  # broken, mid-statement or mid-transaction after an error, or extra


def one(conn: Connection, query: str, params: Mapping[str, Any] | None = None) -> Any:
    """The one row *query* returns (a named tuple)."""
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise LookupError(f"no row from: {query.splitlines()[0]}")
    return row


def scalar(conn: Connection, query: str, params: Mapping[str, Any] | None = None) -> Any:
    """The first column of the one row *query* returns."""
    return one(conn, query, params)[0]
