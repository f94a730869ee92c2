"""The dedup (inbox) table: one mark per (consumer group, message id), and its retention.

A consumer writes the mark in the same transaction as the handler's own writes and commits
the Kafka offset only after that transaction commits. A message redelivered after a crash
(or a rebalance, or a relay re-send) finds its mark and is dropped: the handler's effect on
the database happens once. Marks are the dedup window: :func:`purge_marks` must not run
with a window shorter than the topic's retention plus the worst consumer lag
(:func:`dedup.window.check_window`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, Engine

from outbox.db.arrays import int_array, text_array
from outbox.db.driver import translated
from outbox.db.hashing import stable_hash64
from outbox.db.queries import driver_sql, sql
from outbox.settings import OutboxSettings, default_settings

# psycopg's pipeline mode needs libpq 14 or later (the binary wheel brings its own).
_PIPELINE = psycopg.Pipeline.is_supported()


@dataclass(frozen=True)
class Mark:
    """Where a message was read from, recorded with its dedup mark (for diagnosis)."""

    message_id: str
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class Marks:
    """Many marks as the columns the statements send: what a consumer's batch builds, with
    no :class:`Mark` per message."""

    message_ids: list[str]
    topics: list[str]
    partitions: list[int]
    offsets: list[int]

    @classmethod
    def of(cls, marks: Sequence[Mark]) -> Marks:
        return cls(
            [m.message_id for m in marks],
            [m.topic for m in marks],
            [m.partition for m in marks],
            [m.offset for m in marks],
        )


def mark_many(
    conn: Connection,
    group: str,
    marks: Sequence[Mark] | Marks,
    *,
    settings: OutboxSettings | None = None,
) -> set[str]:
    """Insert the marks of *marks* in one statement; return the message ids that were new.

    Never commits: the marks take effect with the caller's transaction. An id already
    marked (by an earlier delivery, or earlier in *marks*) is absent from the result:
    that delivery is a duplicate.
    """
    columns = marks if isinstance(marks, Marks) else Marks.of(marks)
    if not columns.message_ids:
        return set()
    statement = _driver_sql("insert_marks", settings)
    rows = conn.exec_driver_sql(statement, _parameters(group, columns)).all()
    return {row[0] for row in rows}


def _driver_sql(name: str, settings: OutboxSettings | None) -> str:
    return driver_sql("dedup", name, (settings or default_settings()).schema_name)


def _parameters(group: str, marks: Marks) -> dict[str, object]:
    # Each column as one array literal, made by joins in C: psycopg dumps a list element by
    # element in Python, which cost 2.5 times more CPU per mark here (the marks are most of
    # a no-op batch's statements).
    return {
        "group": group,
        "ids": text_array(marks.message_ids),
        "topics": text_array(marks.topics),
        "partitions": int_array(marks.partitions),
        "offsets": int_array(marks.offsets),
    }


def insert_new(
    conn: Connection,
    group: str,
    marks: Sequence[Mark] | Marks,
    *,
    settings: OutboxSettings | None = None,
) -> None:
    """Insert *marks*, all expected new, with a plain INSERT (no conflict handling).

    The fast path for a batch without duplicates: PostgreSQL's ``ON CONFLICT`` costs a
    speculative insertion per row (an extra index search and WAL record). If one mark is
    there already, this raises ``sqlalchemy.exc.IntegrityError`` and the transaction is
    aborted: only for a caller that owns the transaction, rolls it back and starts over
    with :func:`mark_many` (the consumer's batch, whose marks are its first statement).
    """
    columns = marks if isinstance(marks, Marks) else Marks.of(marks)
    if columns.message_ids:
        statement = _driver_sql("insert_new_marks", settings)
        parameters = _parameters(group, columns)
        if _first_in_transaction(conn, statement, parameters) is None:
            conn.exec_driver_sql(statement, parameters)


def commit_then_insert_new(
    conn: Connection,
    group: str,
    marks: Sequence[Mark] | Marks,
    *,
    settings: OutboxSettings | None = None,
) -> bool | None:
    """Commit the caller's transaction and, in the same round trip, begin the next one with
    *marks* inserted as :func:`insert_new` does (``COMMIT``, ``BEGIN`` and the ``INSERT`` in
    psycopg's pipeline mode: PostgreSQL runs the three in order, the ``BEGIN`` and the
    marks only if the commit succeeded).

    Returns None when the driver cannot (not psycopg, no pipeline mode in its libpq, or no
    marks): nothing was sent, and
    the caller commits the usual way. True: committed, and a new transaction is open on the
    connection holding the marks; SQLAlchemy's transaction object the caller holds stands
    for that one now (commit or roll it back as the next transaction). False: committed,
    but a mark was there already (or the insert failed otherwise): the new transaction is
    aborted and the caller must roll it back (SQLAlchemy's transaction object), which
    leaves the commit done.

    Raises:
        sqlalchemy.exc.DBAPIError: the commit failed (nothing committed, as
            ``Transaction.commit`` raises it), or its answer was lost (the connection broke:
            whether it committed is unknown, as with any commit).
    """
    columns = marks if isinstance(marks, Marks) else Marks.of(marks)
    raw = conn.connection.driver_connection
    if not (columns.message_ids and _PIPELINE and isinstance(raw, psycopg.Connection)
            and not raw.autocommit and raw.info.transaction_status == TransactionStatus.INTRANS):
        return None
    statement = _driver_sql("insert_new_marks", settings)
    parameters = _parameters(group, columns)
    try:
        # One round trip in psycopg's pipeline mode: PostgreSQL runs the three in order and,
        # after an error, skips the rest up to the pipeline's end. The BEGIN is explicit
        # (psycopg adds one only to a connection it knows idle, and this one is not yet).
        with raw.pipeline():
            raw.execute("COMMIT")
            raw.execute("BEGIN")
            raw.execute(statement, parameters)
    except psycopg.Error as exc:
        if _status(raw) == TransactionStatus.INERROR:
            return False  # the commit went through (BEGIN ran after it); the marks did not
        raise translated(conn, exc, "COMMIT", {}) from exc
    return True


def _status(raw: psycopg.Connection[Any]) -> TransactionStatus:
    return raw.info.transaction_status


def mark(
    conn: Connection, group: str, one: Mark, *, settings: OutboxSettings | None = None
) -> bool:
    """Insert one mark; True if it was new (process the message), False for a duplicate.

    As a transaction's first statement (per-message mode: a transaction per message), the
    mark goes in one round trip with the BEGIN psycopg sends first (its pipeline mode):
    at thousands of messages a second, each round trip saved is a wait and a thread switch.
    """
    statement = _driver_sql("insert_mark", settings)
    parameters = {"group": group, "id": one.message_id, "topic": one.topic,
                  "part": one.partition, "off": one.offset}
    cursor = _first_in_transaction(conn, statement, parameters)
    if cursor is not None:
        return cursor.fetchone() is not None
    return conn.exec_driver_sql(statement, parameters).first() is not None


def _first_in_transaction(
    conn: Connection, statement: str, parameters: dict[str, object]
) -> psycopg.Cursor[Any] | None:
    """Run *statement* with the ``BEGIN`` psycopg sends first, in one round trip (its
    pipeline mode), when it is the transaction's first; None when it is not (or the driver
    cannot), for the caller to run it the usual way.

    Each round trip saved is a wait, and a wait for the interpreter's lock after it, which
    the Kafka client's thread may hold for milliseconds.
    """
    raw = conn.connection.driver_connection
    if not (isinstance(raw, psycopg.Connection) and not raw.autocommit and _PIPELINE
            and raw.info.transaction_status == TransactionStatus.IDLE):
        return None
    try:
        with raw.pipeline():
            cursor = raw.execute(statement, parameters)
    except psycopg.Error as exc:
        raise translated(conn, exc, statement, parameters) from exc
    return cursor


def unmark(
    conn: Connection, group: str, message_id: str, *, settings: OutboxSettings | None = None
) -> bool:
    """Remove a mark inside the caller's transaction (its handler failed, or a replay);
    True if there was one."""
    done = conn.exec_driver_sql(
        _driver_sql("unmark", settings), {"group": group, "id": message_id}
    )
    return bool(done.rowcount)


def is_marked(
    conn: Connection, group: str, message_id: str, *, settings: OutboxSettings | None = None
) -> bool:
    """True when *group* has processed *message_id* (within the dedup window)."""
    found = conn.exec_driver_sql(
        _driver_sql("is_marked", settings), {"group": group, "id": message_id}
    ).first()
    return found is not None


def purge_marks(
    engine: Engine,
    group: str,
    *,
    older_than_s: float,
    batch: int,
    max_batches: int = 100,
    settings: OutboxSettings | None = None,
) -> int:
    """Delete *group*'s marks older than *older_than_s*, in batches; return how many went.

    Each batch is its own short transaction, and only the process holding the group's
    retention lock (``pg_try_advisory_xact_lock``) works; the others return 0 at once. Only
    the group's own marks: other groups may keep a longer window.
    """
    schema = (settings or default_settings()).schema_name
    deleted = 0
    lock = stable_hash64(b"outboxkit.dedup.retention", schema.encode(), group.encode())
    for _ in range(max_batches):
        with engine.begin() as conn:
            if not conn.execute(sql("dedup", "retention_lock", schema), {"k": lock}).scalar():
                return deleted
            count = conn.exec_driver_sql(
                driver_sql("dedup", "purge_marks", schema),
                {"group": group, "older": older_than_s, "batch": batch},
            ).rowcount
        deleted += count
        if count < batch:
            break
    return deleted
