"""Outbox rows as an operator sees them: list the backlog or the failures, retry failed rows.

Functions take the caller's ``Connection``/``Session`` and **never commit**. A retried row is
``pending`` again with its blocking flag and last error cleared, so the relay publishes it
(and the later messages of its key it was holding back) on its next claim.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Integer, Text, cast, func, literal, literal_column, select, update
from sqlalchemy.dialects.postgresql import ARRAY

from outbox.errors import ConfigurationError, RetryRefused
from outbox.execution import Plan, SyncConn, run_plan
from outbox.settings import OutboxSettings, default_settings
from outbox.tables import outbox_messages

messages = outbox_messages
Listed = Literal["pending", "failed", "published"]


@dataclass(frozen=True)
class Message:
    """One outbox row without its payload (what ``outbox messages list`` prints)."""

    id: int
    message_id: uuid.UUID
    topic: str
    key: str | None
    message_type: str
    status: str
    blocking: bool
    attempts: int
    last_error: str | None
    run_id: uuid.UUID | None
    created_at: datetime
    failed_at: datetime | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_messages_plan(status: Listed, topic: str | None, limit: int) -> Plan[list[Message]]:
    if limit <= 0:
        raise ConfigurationError(f"limit must be > 0, got {limit}")
    m = messages
    query = (
        select(m.c.id, m.c.message_id, m.c.topic, m.c.key, m.c.message_type, m.c.status,
               m.c.blocking, m.c.attempts, m.c.last_error, m.c.run_id, m.c.created_at,
               m.c.failed_at)
        .where(m.c.status == status).order_by(m.c.id).limit(limit)
    )
    if topic is not None:
        query = query.where(m.c.topic == topic)
    rows = yield query
    return [
        Message(**{**dict(row), "key": None if row["key"] is None
                   else bytes(row["key"]).decode("utf-8", "backslashreplace")})
        for row in rows
    ]


def retry_plan(ids: Collection[int] | None, channel: str) -> Plan[int]:
    m = messages
    if ids is not None:
        wanted = sorted(set(ids))
        if not wanted:
            raise ConfigurationError("name the messages to retry (their ids)")
        rows = yield (select(m.c.id, m.c.status).where(m.c.id.in_(wanted))
                      .with_for_update())
        found = {row["id"]: row["status"] for row in rows}
        problems = {i: found.get(i) for i in wanted if found.get(i) != "failed"}
        if problems:
            raise RetryRefused(problems)
    retried = (
        update(m).where(m.c.status == "failed")
        .values(status="pending", blocking=False, last_error=None, failed_at=None,
                kafka_partition=None, kafka_offset=None)
        .returning(m.c.lane)
    )
    if ids is not None:
        retried = retried.where(m.c.id.in_(sorted(set(ids))))
    rows = yield retried
    lanes = sorted({row["lane"] for row in rows})
    if lanes:
        # Wake an idle relay for each lane touched: a rare operator action may pay for NOTIFY.
        yield select(func.pg_notify(channel, cast(literal_column("lane"), Text))).select_from(
            func.unnest(literal(lanes, ARRAY(Integer))).alias("lane"))
    return len(rows)


def list_messages(conn: SyncConn, *, status: Listed = "pending", topic: str | None = None,
                  limit: int = 100, settings: OutboxSettings | None = None) -> list[Message]:
    """Outbox rows with *status* (oldest first), optionally of one *topic*; payloads left out."""
    return run_plan(conn, list_messages_plan(status, topic, limit), settings)


def retry_messages(conn: SyncConn, ids: Collection[int] | None = None, *,
                   settings: OutboxSettings | None = None) -> int:
    """Set failed rows back to ``pending`` (all failed rows when *ids* is None); never commits.

    Clears ``blocking`` and ``last_error``, so the relay publishes them again, in id order,
    before the later messages of their key. Returns how many rows changed. Raises
    :class:`RetryRefused` (changing nothing) when an id is unknown or not ``failed``.
    """
    channel = (settings or default_settings()).notify_channel
    return run_plan(conn, retry_plan(ids, channel), settings)
