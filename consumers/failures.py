"""The failures table: messages a consumer could not handle, and what became of them.

Attempts are counted here, in their own short transactions, so they survive crashes and
restarts: a message that keeps failing reaches the dead-letter topic after the configured
number of attempts however often the consumer restarts in between. Statuses:

* ``retrying`` — failed at least once, will be tried again;
* ``recovered`` — a later attempt succeeded;
* ``dead-lettered`` — copied to the dead-letter topic; the consumer went on past it;
* ``replayed`` — an operator re-published or re-handled it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert

from consumers.errors import FailureNotFound, NotDeadLettered
from outbox.db.tables import consumer_failures
from outbox.errors import ConfigurationError

STATUSES = ("retrying", "recovered", "dead-lettered", "replayed", "discarded")


@dataclass(frozen=True)
class FailedMessage:
    """One row of the failures table."""

    id: int
    consumer_group: str
    topic: str
    partition: int
    offset: int
    message_id: str | None
    key: bytes | None
    payload: bytes | None
    headers: dict[str, str]
    attempts: int
    last_error: str | None
    status: str
    first_failed_at: datetime
    last_failed_at: datetime
    dead_lettered_at: datetime | None
    dlq_topic: str | None
    replayed_at: datetime | None
    discarded_by: str | None = None
    discard_reason: str | None = None
    replayed_by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly (bytes as UTF-8 with replacement), for ``--json`` output."""
        out = {k: v for k, v in self.__dict__.items() if not isinstance(v, bytes)}
        out["key"] = self.key.decode("utf-8", "replace") if self.key is not None else None
        out["payload"] = (
            self.payload.decode("utf-8", "replace") if self.payload is not None else None
        )
        return out


@dataclass(frozen=True)
class Attempt:
    """What :func:`record_attempt` left in the table."""

    attempts: int
    status: str


def headers_json(headers: Sequence[tuple[str, bytes | None]]) -> dict[str, str]:
    """Kafka headers as a JSON object (values decoded as UTF-8, undecodable bytes escaped)."""
    return {name: (value or b"").decode("utf-8", "backslashreplace") for name, value in headers}


def record_attempt(
    conn: Connection,
    *,
    group: str,
    topic: str,
    partition: int,
    offset: int,
    message_id: str | None,
    key: bytes | None,
    payload: bytes | None,
    headers: Mapping[str, str],
    error: str,
) -> Attempt:
    """Count one failed attempt at the message at (topic, partition, offset).

    Never commits; run it in its own short transaction so the count survives a crash. A
    message already dead-lettered or replayed keeps its status (a redelivery of it must not
    be sent to the dead-letter topic again).
    """
    t = consumer_failures
    stmt = (
        insert(t)
        .values(
            consumer_group=group,
            topic=topic,
            kafka_partition=partition,
            kafka_offset=offset,
            message_id=message_id,
            key=key,
            payload=payload,
            headers=json.loads(json.dumps(dict(headers))),
            attempts=1,
            last_error=error[:4000],
        )
        .on_conflict_do_update(
            constraint="consumer_failures_position_key",
            set_={
                "attempts": t.c.attempts + 1,
                "last_error": error[:4000],
                "last_failed_at": _now(),
            },
        )
        .returning(t.c.attempts, t.c.status)
    )
    row = conn.execute(stmt).one()
    return Attempt(row.attempts, row.status)


def mark_dead_lettered(
    conn: Connection,
    *,
    group: str,
    topic: str,
    partition: int,
    offset: int,
    dlq_topic: str,
    dlq_partition: int | None,
    dlq_offset: int | None,
) -> None:
    """Record where the dead-letter copy went; never commits."""
    conn.execute(
        update(consumer_failures)
        .where(*_position(group, topic, partition, offset))
        .values(
            status="dead-lettered",
            dead_lettered_at=_now(),
            dlq_topic=dlq_topic,
            dlq_partition=dlq_partition,
            dlq_offset=dlq_offset,
        )
    )


def mark_recovered(
    conn: Connection, *, group: str, topic: str, partition: int, offset: int
) -> None:
    """A later attempt succeeded; never commits (call it in the success transaction)."""
    conn.execute(
        update(consumer_failures)
        .where(
            *_position(group, topic, partition, offset), consumer_failures.c.status == "retrying"
        )
        .values(status="recovered")
    )


def retrying_among(
    conn: Connection, *, group: str, positions: Sequence[tuple[str, int, int]]
) -> frozenset[tuple[str, int, int]]:
    """Which of *positions* (topic, partition, offset) an earlier attempt left ``retrying``.

    A process that parked a message remembers it in memory; a process that reads it after a
    restart or a rebalance learns it here, so that handling it marks it ``recovered``.
    """
    if not positions:
        return frozenset()
    t = consumer_failures
    found = conn.execute(
        select(t.c.topic, t.c.kafka_partition, t.c.kafka_offset).where(
            t.c.consumer_group == group,
            t.c.status == "retrying",
            tuple_(t.c.topic, t.c.kafka_partition, t.c.kafka_offset).in_(list(positions)),
        )
    )
    return frozenset((r.topic, r.kafka_partition, r.kafka_offset) for r in found)


def retrying_from(
    conn: Connection, *, group: str, topic: str, partition: int, offset: int
) -> frozenset[int]:
    """Offsets from *offset* on in one partition that an earlier attempt left ``retrying``:
    per-message mode parks a key, not a partition, so a parked message may be anywhere after
    the first record a process reads there (its watermark)."""
    t = consumer_failures
    found = conn.execute(
        select(t.c.kafka_offset).where(
            t.c.consumer_group == group,
            t.c.status == "retrying",
            t.c.topic == topic,
            t.c.kafka_partition == partition,
            t.c.kafka_offset >= offset,
        )
    )
    return frozenset(found.scalars())


def mark_replayed(conn: Connection, failure_id: int) -> None:
    """An operator replayed the failure; never commits."""
    conn.execute(
        update(consumer_failures)
        .where(consumer_failures.c.id == failure_id)
        .values(status="replayed", replayed_at=_now())
    )


def take_for_replay(conn: Connection, failure_id: int, *, again: bool = False,
                    actor: str | None = None) -> FailedMessage | None:
    """Move a dead-lettered failure to ``replayed``, only if it still is dead-lettered (a
    compare-and-set: of two operators replaying it at once, one gets it); never commits.
    *again*: a ``replayed`` one too; *actor*: who (kept). ``None``: it was not (or does
    not exist)."""
    statuses = ("dead-lettered", "replayed") if again else ("dead-lettered",)
    row = conn.execute(
        update(consumer_failures)
        .where(consumer_failures.c.id == failure_id,
               consumer_failures.c.status.in_(statuses))
        .values(status="replayed", replayed_at=_now(), replayed_by=actor)
        .returning(*consumer_failures.c)
    ).first()
    return _failed_message(row._mapping) if row is not None else None


def discard(conn: Connection, failure_id: int, *, actor: str, reason: str) -> FailedMessage:
    """A person decided this dead letter will never be handled: ``discarded``, with who and
    why; never commits. Only a dead-lettered one (a compare-and-set, as a replay's):
    :class:`NotDeadLettered` otherwise, :class:`FailureNotFound` if there is none."""
    if not actor.strip() or not reason.strip():
        raise ConfigurationError("a discard says who and why (actor and reason)")
    row = conn.execute(
        update(consumer_failures)
        .where(consumer_failures.c.id == failure_id,
               consumer_failures.c.status == "dead-lettered")
        .values(status="discarded", discarded_by=actor, discard_reason=reason)
        .returning(*consumer_failures.c)
    ).first()
    if row is not None:
        return _failed_message(row._mapping)
    found = get_failure(conn, failure_id)
    if found is None:
        raise FailureNotFound(failure_id)
    raise NotDeadLettered(failure_id, found.status, "discard")


def failure_groups(conn: Connection, *, status: str = "dead-lettered",
                   limit: int = 50) -> list[dict[str, Any]]:
    """Failures of *status* grouped by group, topic and the first line of their error, the
    biggest first: what an operator fixes once for many messages."""
    t = consumer_failures
    reason = func.split_part(func.coalesce(t.c.last_error, ""), "\n", 1).label("reason")
    rows = conn.execute(
        select(t.c.consumer_group, t.c.topic, reason, func.count().label("messages"),
               func.min(t.c.first_failed_at).label("first"),
               func.max(t.c.last_failed_at).label("last"))
        .where(t.c.status == status)
        .group_by(t.c.consumer_group, t.c.topic, reason)
        .order_by(func.count().desc(), t.c.consumer_group, t.c.topic).limit(limit)).all()
    return [dict(r._mapping) for r in rows]


def give_back(conn: Connection, before: FailedMessage) -> None:
    """Undo :func:`take_for_replay` when the replay could not be sent: the failure as it was
    *before* (dead-lettered; or replayed by someone earlier, for a replay ``again``); never
    commits."""
    conn.execute(
        update(consumer_failures)
        .where(consumer_failures.c.id == before.id,
               consumer_failures.c.status == "replayed")
        .values(status=before.status, replayed_at=before.replayed_at,
                replayed_by=before.replayed_by)
    )


def get_failure(conn: Connection, failure_id: int, *,
                lock: bool = False) -> FailedMessage | None:
    """The failure with this id, or None; *lock*: its row locked until the transaction ends
    (what a replay reads before it changes it)."""
    query = select(consumer_failures).where(consumer_failures.c.id == failure_id)
    row = conn.execute(query.with_for_update() if lock else query).first()
    return _failed_message(row._mapping) if row is not None else None


def list_failures(
    conn: Connection,
    *,
    group: str | None = None,
    status: str | None = "dead-lettered",
    limit: int = 100,
) -> list[FailedMessage]:
    """Failures, oldest first; by default the dead-lettered ones (what needs an operator)."""
    stmt = select(consumer_failures).order_by(consumer_failures.c.id).limit(limit)
    if group is not None:
        stmt = stmt.where(consumer_failures.c.consumer_group == group)
    if status is not None:
        stmt = stmt.where(consumer_failures.c.status == status)
    return [_failed_message(row._mapping) for row in conn.execute(stmt)]


def _position(group: str, topic: str, partition: int, offset: int) -> list[Any]:
    t = consumer_failures
    return [
        t.c.consumer_group == group,
        t.c.topic == topic,
        t.c.kafka_partition == partition,
        t.c.kafka_offset == offset,
    ]


def _now() -> Any:
    return func.now()


def _failed_message(row: Any) -> FailedMessage:
    return FailedMessage(
        id=row["id"],
        consumer_group=row["consumer_group"],
        topic=row["topic"],
        partition=row["kafka_partition"],
        offset=row["kafka_offset"],
        message_id=row["message_id"],
        key=bytes(row["key"]) if row["key"] is not None else None,
        payload=bytes(row["payload"]) if row["payload"] is not None else None,
        headers=dict(row["headers"] or {}),
        attempts=row["attempts"],
        last_error=row["last_error"],
        status=row["status"],
        first_failed_at=row["first_failed_at"],
        last_failed_at=row["last_failed_at"],
        dead_lettered_at=row["dead_lettered_at"],
        dlq_topic=row["dlq_topic"],
        replayed_at=row["replayed_at"],
        discarded_by=row["discarded_by"],
        discard_reason=row["discard_reason"],
        replayed_by=row["replayed_by"],
    )
