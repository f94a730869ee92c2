"""A pooled connection kept checked out between uses.

Checking a connection out of SQLAlchemy's pool and back in (its events, the fairy, a new
``Connection`` object) costs about 100 µs of Python on these machines. A relay at light
traffic claims and records about a hundred times a second, each on a pool of its own, so
that bookkeeping was a sixth of its CPU. Kept, the connection is checked out once.

What the pool did for it still happens: after ``idle_s`` unused it is tested before the next
use (as the engine's ping-after-idle test does, :func:`outbox.db.dsn.engine_for`) and
replaced if the server went away meanwhile; after an error it goes back to the pool (thrown
away if SQLAlchemy invalidated it), so a failed use never hands an unknown state to the next.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DisconnectionError

from outbox.db.dsn import ping


class KeptConnection:
    """One connection of *engine*, for one use at a time (a lock serialises threads)."""

    def __init__(self, engine: Engine, idle_s: float) -> None:
        self._engine = engine
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._used = 0.0

    @contextlib.contextmanager
    def use(self) -> Iterator[Connection]:
        """The connection, as its engine makes them; a transaction the use began is
        committed at its end (none is, in autocommit, unless SQLAlchemy's own statements
        were used)."""
        with self._lock:
            conn = self._fresh()
            try:
                yield conn
                if conn.in_transaction():
                    conn.commit()
            except BaseException:
                self._drop()
                raise
            self._used = time.monotonic()

    def _fresh(self) -> Connection:
        conn = self._conn
        if conn is not None and conn.invalidated:
            self._drop()
        elif conn is not None and time.monotonic() - self._used >= self._idle_s:
            try:
                ping(conn.connection.driver_connection)
            except DisconnectionError as exc:
                conn.invalidate(exc)
                self._drop()
        if self._conn is None:
            self._conn = self._engine.connect()
        return self._conn

    def _drop(self) -> None:
        """Give the connection back to the pool: rolled back, or thrown away if broken."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        with self._lock:
            self._drop()
