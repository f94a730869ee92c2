"""The dedup (inbox) table: one mark per (consumer group, message id), and its retention.

A consumer writes the mark in the same transaction as the handler's own writes and commits
the Kafka offset only after that transaction commits. A message redelivered after a crash
(or a rebalance, or a relay re-send) finds its mark and is dropped: the handler's effect on
the database happens once. Marks are the dedup window: :func:`purge_marks` must not run
with a window shorter than the topic's retention plus the worst consumer lag
(:func:`dedup.window.check_window`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, text

from outbox.hashing import stable_hash64


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
    conn: Connection, schema: str, group: str, marks: Sequence[Mark] | Marks
) -> set[str]:
    """Insert the marks of *marks* in one statement; return the message ids that were new.

    Never commits: the marks take effect with the caller's transaction. An id already
    marked (by an earlier delivery, or earlier in *marks*) is absent from the result:
    that delivery is a duplicate.
    """
    columns = marks if isinstance(marks, Marks) else Marks.of(marks)
    if not columns.message_ids:
        return set()
    rows = conn.exec_driver_sql(_insert(schema), _parameters(group, columns)).all()
    return {row[0] for row in rows}


def _parameters(group: str, marks: Marks) -> dict[str, object]:
    return {
        "group": group,
        "ids": marks.message_ids,
        "topics": marks.topics,
        "partitions": marks.partitions,
        "offsets": marks.offsets,
    }


def insert_new(conn: Connection, schema: str, group: str, marks: Sequence[Mark] | Marks) -> None:
    """Insert *marks*, all expected new, with a plain INSERT (no conflict handling).

    The fast path for a batch without duplicates: PostgreSQL's ``ON CONFLICT`` costs a
    speculative insertion per row (an extra index search and WAL record). If one mark is
    there already, this raises ``sqlalchemy.exc.IntegrityError`` and the transaction is
    aborted: only for a caller that owns the transaction, rolls it back and starts over
    with :func:`mark_many` (the consumer's batch, whose marks are its first statement).
    """
    columns = marks if isinstance(marks, Marks) else Marks.of(marks)
    if columns.message_ids:
        conn.exec_driver_sql(_insert_new(schema), _parameters(group, columns))


def mark(conn: Connection, schema: str, group: str, one: Mark) -> bool:
    """Insert one mark; True if it was new (process the message), False for a duplicate."""
    return bool(mark_many(conn, schema, group, [one]))


def unmark(conn: Connection, schema: str, group: str, message_id: str) -> None:
    """Remove a mark inside the caller's transaction (its handler failed, or a replay)."""
    conn.exec_driver_sql(
        f'DELETE FROM "{schema}".consumer_inbox '
        "WHERE consumer_group = %(group)s AND message_id = %(id)s",
        {"group": group, "id": message_id},
    )


def is_marked(conn: Connection, schema: str, group: str, message_id: str) -> bool:
    """True when *group* has processed *message_id* (within the dedup window)."""
    return (
        conn.exec_driver_sql(
            f'SELECT 1 FROM "{schema}".consumer_inbox '
            "WHERE consumer_group = %(group)s AND message_id = %(id)s",
            {"group": group, "id": message_id},
        ).first()
        is not None
    )


def purge_marks(
    engine: Engine,
    schema: str,
    group: str,
    *,
    older_than_s: float,
    batch: int,
    max_batches: int = 100,
) -> int:
    """Delete *group*'s marks older than *older_than_s*, in batches; return how many went.

    Each batch is its own short transaction, and only the process holding the group's
    retention lock (``pg_try_advisory_xact_lock``) works; the others return 0 at once. Only
    the group's own marks: other groups may keep a longer window.
    """
    deleted = 0
    lock = stable_hash64(b"outboxkit.dedup.retention", schema.encode(), group.encode())
    for _ in range(max_batches):
        with engine.begin() as conn:
            if not conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": lock}).scalar():
                return deleted
            count = conn.exec_driver_sql(
                _purge(schema), {"group": group, "older": older_than_s, "batch": batch}
            ).rowcount
        deleted += count
        if count < batch:
            break
    return deleted


_INSERT = """
    INSERT INTO "{schema}".consumer_inbox
        (consumer_group, message_id, topic, kafka_partition, kafka_offset)
    SELECT %(group)s, m.id, m.topic, m.part, m.off
    FROM unnest(CAST(%(ids)b AS text[]), CAST(%(topics)b AS text[]),
                CAST(%(partitions)b AS integer[]), CAST(%(offsets)b AS bigint[]))
         AS m(id, topic, part, off)
"""


@functools.cache
def _insert(schema: str) -> str:
    # One round trip per batch; ON CONFLICT DO NOTHING also absorbs an id twice in the batch.
    # The arrays go in binary (%(name)b): text arrays in text form cost a regex per element.
    return _INSERT.format(schema=schema) + """
    ON CONFLICT (consumer_group, message_id) DO NOTHING
    RETURNING message_id
    """


@functools.cache
def _insert_new(schema: str) -> str:
    return _INSERT.format(schema=schema)


@functools.cache
def _purge(schema: str) -> str:
    return f"""
    WITH doomed AS (
        SELECT consumer_group, message_id FROM "{schema}".consumer_inbox
        WHERE consumer_group = %(group)s
          AND processed_at < now() - make_interval(secs => %(older)s)
        ORDER BY processed_at
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM "{schema}".consumer_inbox AS i USING doomed
    WHERE i.consumer_group = doomed.consumer_group AND i.message_id = doomed.message_id
    """
