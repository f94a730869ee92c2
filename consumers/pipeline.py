"""A batch's plain INSERTs kept and sent together, without waiting for each answer.

A handler that writes one row per message through ``ctx.conn`` used to pay, per message, a
round trip to PostgreSQL and psycopg's whole per-statement path (a send, a wait, a result):
most of a batch's time. Inside :func:`kept_inserts`, a statement whose answer nobody can
need (a plain ``INSERT`` without ``RETURNING``, ``ON CONFLICT`` or ``SELECT``:
:func:`deferrable`) is kept, and kept ones are sent as runs of ``executemany`` over
psycopg's pipeline mode, in their order, before any other statement, every ``SEND_EVERY``
rows and before the commit. Every other statement (a ``SELECT``, ``RETURNING``, an
``UPDATE`` or ``DELETE`` whose row count a handler may check, a savepoint) is sent when it
is executed and waits for its answer, as outside the block: the handler sees its rows and
its ``rowcount`` as before, and every statement reaches PostgreSQL in the order the handler
executed it. This works at the driver's cursor, under SQLAlchemy: ``ctx.conn.execute``, an
ORM session on it and the psycopg connection itself are all kept in order.

What changes inside the block: a kept ``INSERT``'s ``rowcount`` is -1 (unknown, as PEP 249
allows), and its error (a unique violation, say) is raised by a later statement or at the
commit, not by the ``INSERT``. The consumer uses the block only on its optimistic path
(:meth:`consumers.processing.Processor._plain`), where any error rolls the whole batch back
and the careful path, without the block, settles which message failed.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import Connection

# Words that make an INSERT's answer worth waiting for: rows (RETURNING), or a row count
# that depends on the data (ON CONFLICT DO NOTHING, INSERT ... SELECT ... WHERE NOT EXISTS).
# Matching them anywhere (in a comment or a string too) only makes a statement wait.
_NEEDS_ANSWER = re.compile(r"\b(returning|conflict|select)\b", re.IGNORECASE)
_LEADING_COMMENTS = re.compile(r"(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.DOTALL)
_INSERT = re.compile(r"insert\s", re.IGNORECASE)


@functools.lru_cache(maxsize=1024)
def deferrable(statement: str) -> bool:
    """True when *statement* is an INSERT whose answer is only "done" (or an error).

    Its row count is then the number of rows given, unless a trigger or a rule drops some:
    a handler that relies on that count must add ``RETURNING`` (the statement then waits).
    """
    found = _LEADING_COMMENTS.match(statement)
    body = statement[found.end() if found else 0 :]
    return _INSERT.match(body) is not None and _NEEDS_ANSWER.search(body) is None


# Kept rows sent as soon as there are this many: PostgreSQL then executes them while the
# handlers go on (the two overlap on two cores), instead of all of them after the last one.
SEND_EVERY = 100


class _Queue:
    """Kept statements of one connection, in order: runs of (statement, parameter sets)."""

    def __init__(self, pipeline: psycopg.Pipeline, cursor: psycopg.Cursor[Any]) -> None:
        self.pipeline = pipeline
        self.cursor = cursor  # a plain cursor: sends the runs
        self.runs: list[tuple[str, list[Any]]] = []
        self.rows = 0

    def keep(self, statement: str, parameters: Any) -> None:
        last = self.runs[-1] if self.runs else None
        # A run is one statement, all with parameters or all without (sent differently).
        if last is not None and last[0] == statement and (last[1][0] is None) == (
                parameters is None):
            last[1].append(parameters)
        else:
            self.runs.append((statement, [parameters]))
        self.rows += 1
        if self.rows >= SEND_EVERY:
            self.send()

    def send(self) -> None:
        """Send the kept statements, in order, without waiting for their answers."""
        runs, self.runs, self.rows = self.runs, [], 0
        for statement, rows in runs:
            if rows[0] is None:  # executed without parameters: no placeholders to fill
                for _ in rows:
                    self.cursor.execute(statement)
            else:
                self.cursor.executemany(statement, rows)


class Kept:
    """The caller's handle on the block: :meth:`send` what is kept before committing."""

    def __init__(self, queue: _Queue | None) -> None:
        self._queue = queue

    def send(self) -> None:
        """Send every kept statement (the commit must come after them all)."""
        if self._queue is not None:
            self._queue.send()

    def discard(self) -> None:
        """Before a rollback: drop what is kept and read every answer still due.

        After an error, the statements sent behind it answer "pipeline aborted"; left
        unread, the rollback would read them and raise instead of rolling back. They are
        the same failure, already being handled: not raised again.
        """
        if self._queue is not None:
            self._queue.runs, self._queue.rows = [], 0
            with contextlib.suppress(psycopg.Error):
                self._queue.pipeline.sync()


# The queue of each connection inside the block, by id(): cursors find it through their
# connection. Only the handler thread of a consumer uses a given connection at a time.
_QUEUES: dict[int, _Queue] = {}


class _KeepingCursor(psycopg.Cursor[Any]):
    """A cursor that keeps deferrable statements and makes the others wait for answers."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None,
        binary: bool | None = None,
    ) -> _KeepingCursor:
        queue = _QUEUES.get(id(self._conn))
        if queue is None:  # the block ended, the cursor lives on: a plain cursor
            return super().execute(query, params, prepare=prepare, binary=binary)
        if (prepare is None and binary is None and isinstance(query, str)
                and deferrable(query)):
            queue.keep(query, params)
            return self
        queue.send()  # what came before goes first
        super().execute(query, params, prepare=prepare, binary=binary)
        # SQLAlchemy reads the description and rowcount right after execute: wait for them
        # (and for this statement's error, or a kept one's).
        queue.pipeline.sync()
        return self

    def executemany(
        self, query: Any, params_seq: Iterable[Any], *, returning: bool = False
    ) -> None:
        queue = _QUEUES.get(id(self._conn))
        if queue is None:
            super().executemany(query, params_seq, returning=returning)
            return
        if not returning and isinstance(query, str) and deferrable(query):
            for params in params_seq:
                queue.keep(query, params)
            return
        queue.send()
        super().executemany(query, params_seq, returning=returning)
        queue.pipeline.sync()


@contextmanager
def kept_inserts(conn: Connection) -> Iterator[Kept]:
    """Keep *conn*'s plain INSERTs and send them together, in pipeline mode.

    Run the whole transaction inside the block: its first statement and its commit then
    cost one round trip each (psycopg queues the BEGIN; the COMMIT waits for every answer
    and raises the first error among them). Call ``send()`` on what it yields before the
    commit; what is still kept when the block ends is dropped (the caller rolled back). A
    driver other than psycopg 3, or a cursor class of the application's, runs the block as
    without it.
    """
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection) or raw.cursor_factory is not psycopg.Cursor:
        yield Kept(None)
        return
    with raw.pipeline() as pipeline:
        queue = _QUEUES[id(raw)] = _Queue(pipeline, raw.cursor())
        raw.cursor_factory = _KeepingCursor
        try:
            yield Kept(queue)
        finally:
            raw.cursor_factory = psycopg.Cursor
            del _QUEUES[id(raw)]
            queue.cursor.close()
