"""Outbox rows as an operator sees them: list the backlog or the failures, retry failed rows.

Functions take the caller's ``Connection``/``Session`` and **never commit**. The relay never
changes an outbox row: what it did is in ``outbox_failures`` (refused rows, copied whole) and
``deliveries`` (the broker's proof), and the view ``message_status`` puts it together. A
retried row (and the rows of its key held back behind it) is set to ``retry``: the relay
publishes it again, in id order, before the later messages of its key.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import (
    Boolean,
    Integer,
    Text,
    cast,
    column,
    func,
    literal,
    literal_column,
    select,
    table,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.dialects.postgresql import TIMESTAMP as TIMESTAMPTZ

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.locks import FAILURES_LOCK
from outbox.db.schema import SCHEMA
from outbox.db.tables import outbox_failures
from outbox.errors import ConfigurationError, RetryRefused
from outbox.settings import OutboxSettings, default_settings

Listed = Literal["pending", "failed", "published"]

# The view of migration 0006: every outbox row with what the relay did with it.
message_status = table(
    "message_status",
    column("id", Integer),
    column("message_id", UUID(as_uuid=True)),
    column("topic", Text),
    column("key"),
    column("lane", Integer),
    column("message_type", Text),
    column("run_id", UUID(as_uuid=True)),
    column("created_at", TIMESTAMPTZ(timezone=True)),
    column("status", Text),
    column("last_error", Text),
    column("failed_at", TIMESTAMPTZ(timezone=True)),
    column("blocking", Boolean),
    column("kafka_partition", Integer),
    column("kafka_offset", Integer),
    column("published_at", TIMESTAMPTZ(timezone=True)),
    schema=SCHEMA,
)


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
    last_error: str | None
    run_id: uuid.UUID | None
    created_at: datetime
    failed_at: datetime | None
    # The broker's proof, once published.
    kafka_partition: int | None = None
    kafka_offset: int | None = None
    published_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_messages_plan(status: Listed, topic: str | None, limit: int) -> Plan[list[Message]]:
    if limit <= 0:
        raise ConfigurationError(f"limit must be > 0, got {limit}")
    if status == "failed":
        # Refused rows live in outbox_failures even after retention deleted the outbox row.
        f = outbox_failures
        query = (
            select(f.c.id, f.c.message_id, f.c.topic, f.c.key, f.c.message_type,
                   literal("failed").label("status"), f.c.blocking,
                   f.c.error.label("last_error"), f.c.run_id, f.c.created_at, f.c.failed_at)
            .where(f.c.state == "failed").order_by(f.c.id).limit(limit)
        )
        if topic is not None:
            query = query.where(f.c.topic == topic)
    else:
        query = _status_query().where(message_status.c.status == status).limit(limit)
        if topic is not None:
            query = query.where(message_status.c.topic == topic)
    rows = yield query
    return _messages(rows)


def run_messages_plan(run_id: uuid.UUID) -> Plan[list[Message]]:
    rows = yield _status_query().where(message_status.c.run_id == run_id)
    return _messages(rows)


def _status_query() -> Any:
    m = message_status
    return select(m.c.id, m.c.message_id, m.c.topic, m.c.key, m.c.message_type, m.c.status,
                  m.c.blocking, m.c.last_error, m.c.run_id, m.c.created_at, m.c.failed_at,
                  m.c.kafka_partition, m.c.kafka_offset, m.c.published_at).order_by(m.c.id)


def _messages(rows: Any) -> list[Message]:
    return [
        Message(**{**dict(row), "key": None if row["key"] is None
                   else bytes(row["key"]).decode("utf-8", "backslashreplace")})
        for row in rows
    ]


def retry_plan(ids: Collection[int] | None, channel: str) -> Plan[int]:
    f = outbox_failures
    yield select(func.pg_advisory_xact_lock(FAILURES_LOCK))
    if ids is not None:
        wanted = sorted(set(ids))
        if not wanted:
            raise ConfigurationError("name the messages to retry (their ids)")
        rows = yield (select(f.c.id, f.c.state).where(f.c.id.in_(wanted)).with_for_update())
        found = {row["id"]: _shown(row["state"]) for row in rows}
        missing = [i for i in wanted if i not in found]
        if missing:
            m = message_status
            rows = yield select(m.c.id, m.c.status).where(m.c.id.in_(missing))
            found |= {row["id"]: row["status"] for row in rows}
        problems = {i: found.get(i) for i in wanted if found.get(i) != "failed"}
        if problems:
            raise RetryRefused(problems)
    retried = (
        update(f).where(f.c.state == "failed").values(state="retry", blocking=False, error=None)
        .returning(f.c.lane, f.c.topic, f.c.key)
    )
    if ids is not None:
        retried = retried.where(f.c.id.in_(sorted(set(ids))))
    rows = yield retried
    keys = {(row["lane"], row["topic"], row["key"]) for row in rows}
    if keys:
        # The rows held back behind a retried one follow it, in id order. (Keyless rows are
        # no longer held back, but earlier versions held them: IN never matches a NULL key.)
        keyed = sorted((k for k in keys if k[2] is not None), key=repr)
        keyless = sorted((lane, topic) for lane, topic, key in keys if key is None)
        if keyed:
            yield (update(f).where(f.c.state == "held")
                   .where(tuple_(f.c.lane, f.c.topic, f.c.key).in_(keyed))
                   .values(state="retry"))
        if keyless:
            yield (update(f).where(f.c.state == "held", f.c.key.is_(None))
                   .where(tuple_(f.c.lane, f.c.topic).in_(keyless))
                   .values(state="retry"))
        lanes = sorted({lane for lane, _, _ in keys})
        # Wake an idle relay for each lane touched: a rare operator action may pay for NOTIFY.
        yield select(func.pg_notify(channel, cast(literal_column("lane"), Text))).select_from(
            func.unnest(literal(lanes, ARRAY(Integer))).alias("lane"))
    return len(rows)


def _shown(state: str) -> str:
    """A failure's state as a message status: held back or being retried is pending."""
    return "pending" if state in ("held", "retry") else state


def list_messages(conn: SyncConn, *, status: Listed = "pending", topic: str | None = None,
                  limit: int = 100, settings: OutboxSettings | None = None) -> list[Message]:
    """Outbox rows with *status* (oldest first), optionally of one *topic*; payloads left out."""
    return run_plan(conn, list_messages_plan(status, topic, limit), settings)


def run_messages(conn: SyncConn, run_id: uuid.UUID, *,
                 settings: OutboxSettings | None = None) -> list[Message]:
    """The outbox messages of run *run_id* in id order, each with its status and, once
    published, the partition and offset Kafka gave it; payloads left out."""
    return run_plan(conn, run_messages_plan(run_id), settings)


def retry_messages(conn: SyncConn, ids: Collection[int] | None = None, *,
                   settings: OutboxSettings | None = None) -> int:
    """Publish failed rows again (all failed rows when *ids* is None); never commits.

    The relay sends them again, in id order, before the later messages of their key (the
    rows held back behind them follow). Returns how many failed rows were retried. Raises
    :class:`RetryRefused` (changing nothing) when an id is unknown or not ``failed``.
    """
    channel = (settings or default_settings()).notify_channel
    return run_plan(conn, retry_plan(ids, channel), settings)
