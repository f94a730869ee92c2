"""The outboxkit tables as SQLAlchemy Core ``Table`` objects: one source of truth.

Tables are declared in the placeholder schema ``outboxkit``; the real schema name comes
from settings and is applied with ``schema_translate_map`` (see :func:`outbox.schema.translate`).
The DDL that creates them lives in ``outbox/migrations/*.sql``; a test proves the two agree.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP, UUID

SCHEMA = "outboxkit"
metadata = MetaData(schema=SCHEMA)

RUN_STATES = ("queued", "running", "waiting", "done", "failed", "needs-human")
MESSAGE_STATUSES = ("pending", "published", "failed")


def _ts(name: str, *, nullable: bool = True, default_now: bool = False) -> Column[object]:
    return Column(
        name,
        TIMESTAMP(timezone=True),
        nullable=nullable,
        server_default=text("now()") if default_now else None,
    )


schema_versions = Table(
    "schema_versions",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("name", Text, nullable=False),
    _ts("applied_at", nullable=False, default_now=True),
)

workflows = Table(
    "workflows",
    metadata,
    Column("name", Text, primary_key=True),
    Column("version", Text, nullable=False),
    _ts("retired_at"),
    Column("retired_reason", Text),
    _ts("updated_at", nullable=False, default_now=True),
)

agent_runs = Table(
    "agent_runs",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("workflow", Text, nullable=False),
    Column("workflow_version", Text, nullable=False),
    Column("prompt_version", Text),
    Column("tool_schema_version", Text),
    Column("state", Text, nullable=False),
    Column("step", Text),
    Column("checkpoint", JSONB),
    Column("last_evidence", JSONB),
    Column("idempotency_key", Text, nullable=False, unique=True),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    _ts("not_before"),
    Column("lease_owner", Text),
    Column("lease_token", BigInteger, nullable=False, server_default=text("0")),
    _ts("lease_expires_at"),
    Column("version", BigInteger, nullable=False, server_default=text("0")),
    Column("reason", Text),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    _ts("finished_at"),
    _ts("purged_at"),
    CheckConstraint(
        "state IN ('queued', 'running', 'waiting', 'done', 'failed', 'needs-human')",
        name="agent_runs_state_check",
    ),
)
# Claiming scans only runnable rows; a partial index keeps that cheap however long history is.
Index(
    "agent_runs_runnable_idx",
    agent_runs.c.state,
    agent_runs.c.not_before,
    postgresql_where=text("state IN ('queued', 'running')"),
)
Index("agent_runs_finished_idx", agent_runs.c.finished_at, postgresql_where=text("purged_at IS NULL"))

run_transitions = Table(
    "run_transitions",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), nullable=False),
    Column("from_state", Text),
    Column("to_state", Text, nullable=False),
    Column("step", Text),
    Column("reason", Text),
    Column("evidence", JSONB),
    Column("actor", Text),
    Column("lease_token", BigInteger),
    _ts("at", nullable=False, default_now=True),
)
Index("run_transitions_run_idx", run_transitions.c.run_id, run_transitions.c.id)

step_results = Table(
    "step_results",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), primary_key=True),
    Column("step_key", Text, primary_key=True),
    Column("result", JSONB),
    _ts("recorded_at", nullable=False, default_now=True),
)

artifacts = Table(
    "artifacts",
    metadata,
    Column("digest", Text, primary_key=True),
    Column("media_type", Text, nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("content", LargeBinary, nullable=False),
    _ts("created_at", nullable=False, default_now=True),
)

approvals = Table(
    "approvals",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), nullable=False),
    Column("scope", JSONB, nullable=False),
    _ts("requested_at", nullable=False, default_now=True),
    _ts("expires_at", nullable=False),
    Column("granted_by", Text),
    _ts("granted_at"),
    Column("revoked_by", Text),
    _ts("revoked_at"),
    Column("reason", Text),
)
Index("approvals_run_idx", approvals.c.run_id)

outbox_messages = Table(
    "outbox_messages",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("message_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("topic", Text, nullable=False),
    # bytes, not jsonb: jsonb reorders keys and rejects NUL, and Kafka must get what was written
    Column("key", LargeBinary),
    Column("lane", Integer, nullable=False),
    Column("message_type", Text, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("run_id", UUID(as_uuid=True)),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    _ts("created_at", nullable=False, default_now=True),
    _ts("published_at"),
    Column("kafka_partition", Integer),
    Column("kafka_offset", BigInteger),
    CheckConstraint(
        "status IN ('pending', 'published', 'failed')", name="outbox_messages_status_check"
    ),
)
# The relay claims pending rows per lane in id order; the partial index holds only the backlog.
Index(
    "outbox_messages_pending_idx",
    outbox_messages.c.lane,
    outbox_messages.c.id,
    postgresql_where=text("status = 'pending'"),
)

relays = Table(
    "relays",
    metadata,
    Column("relay_id", Text, primary_key=True),
    Column("host", Text),
    Column("pid", Integer),
    # True while the relay has nothing to do and LISTENs: only then do emits pay for NOTIFY.
    Column("idle", Boolean, nullable=False, server_default=text("false")),
    _ts("started_at", nullable=False, default_now=True),
    _ts("heartbeat_at", nullable=False, default_now=True),
)
