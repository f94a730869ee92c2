"""The outboxkit tables as SQLAlchemy Core ``Table`` objects: one source of truth.

Tables are declared in the placeholder schema ``outboxkit``; the real schema name comes
from settings and is applied with ``schema_translate_map`` (see :func:`outbox.db.schema.translate`).
The DDL that creates them lives in ``outbox/db/migrations/*.sql``; a test proves the two agree.
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
    UniqueConstraint,
    func,
    literal_column,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.types import UserDefinedType

from outbox.db.schema import SCHEMA

metadata = MetaData(schema=SCHEMA)
# The dialect Core compiles with outside an engine (migrate's rendered SQL, tests).
DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]  # untyped in SQLAlchemy

RUN_STATES = ("queued", "running", "waiting", "done", "failed", "needs-human")
MESSAGE_STATUSES = ("pending", "published", "failed")


class XID8(UserDefinedType[int]):
    """PostgreSQL's 64-bit transaction id (``pg_current_xact_id()``)."""

    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "xid8"


class PG_SNAPSHOT(UserDefinedType[str]):
    """PostgreSQL's ``pg_snapshot`` (``xmin:xmax:xip,...``), read and written as text."""

    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "pg_snapshot"


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
    # Numbered by the migration file, never by a sequence.
    Column("version", Integer, primary_key=True, autoincrement=False),
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
    Column("awaits_signals", ARRAY(Text)),  # migration 0012
    Column("parent_id", UUID(as_uuid=True), ForeignKey("agent_runs.id")),  # migration 0013
    Column("awaits_children", Integer),  # migration 0013
    _ts("children_since"),  # migration 0013
    _ts("compensating_since"),  # migration 0014
    Column("children_limit", Integer),  # migration 0015
    Column("awaits_failure", Boolean),  # migration 0015
    Column("on_child_failure", Text),  # migration 0015
    Column("failed_child", UUID(as_uuid=True)),  # migration 0015
    CheckConstraint(
        "state IN ('queued', 'running', 'waiting', 'done', 'failed', 'needs-human')",
        name="agent_runs_state_check",
    ),
    CheckConstraint("on_child_failure IN ('fail', 'compensate')",  # migration 0015
                    name="agent_runs_on_child_failure_check"),
)
# Claiming scans only runnable rows; a partial index keeps that cheap however long history is.
Index(
    "agent_runs_runnable_idx",
    agent_runs.c.state,
    agent_runs.c.not_before,
    postgresql_where=text("state IN ('queued', 'running', 'waiting')"),
)
# The claim's probes in claim order (migration 0007): the queued backlog by age, and running
# runs by lease expiry (the timed queued/waiting runs use agent_runs_runnable_idx).
Index(
    "agent_runs_claim_queued_idx",
    agent_runs.c.created_at,
    postgresql_where=text("state = 'queued' AND not_before IS NULL AND purged_at IS NULL"),
)
Index(
    "agent_runs_claim_expired_idx",
    agent_runs.c.lease_expires_at,
    postgresql_where=text("state = 'running' AND purged_at IS NULL"),
)
Index(
    "agent_runs_finished_idx", agent_runs.c.finished_at, postgresql_where=text("purged_at IS NULL")
)
Index("agent_runs_parent_idx", agent_runs.c.parent_id, agent_runs.c.created_at,
      postgresql_where=text("parent_id IS NOT NULL"))
Index("agent_runs_held_idx", agent_runs.c.parent_id, agent_runs.c.not_before,  # migration 0015
      postgresql_where=text("state = 'queued' AND not_before >= '9000-01-01 00:00:00+00'"))
# The console's runs list by keyset, newest first, all states or one (migration 0017).
Index("agent_runs_newest_idx", agent_runs.c.created_at, agent_runs.c.id)
Index("agent_runs_state_newest_idx", agent_runs.c.state, agent_runs.c.created_at, agent_runs.c.id)

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

# What retention removed from a run, when it was asked to keep a copy.
run_archive = Table(
    "run_archive",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), primary_key=True),
    Column("checkpoint", JSONB),
    Column("step_results", JSONB),
    _ts("archived_at", nullable=False, default_now=True),
    Column("log", JSONB),  # migration 0009
)

# A run's append-only log (migration 0009): a durable agent's message history, one entry per
# message, written with the run's fenced checkpoint.
run_log = Table(
    "run_log",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("entry", JSONB, nullable=False),
    CheckConstraint("seq >= 0", name="run_log_seq_check"),
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
    # Bound to one call and spent once (migration 0018): NULL digest for loose-scope approvals.
    Column("digest", Text),
    Column("grant_reason", Text),
    _ts("spent_at"),
    Column("spent_message_id", UUID(as_uuid=True)),
    CheckConstraint("spent_at IS NULL OR (granted_at IS NOT NULL AND digest IS NOT NULL "
                    "AND spent_message_id IS NOT NULL)", name="approvals_spent_check"),
)
Index("approvals_run_idx", approvals.c.run_id)
# The bound approvals newest first, for the audit (migration 0018).
Index("approvals_bound_newest_idx", approvals.c.requested_at,
      postgresql_where=text("digest IS NOT NULL"))
# The approvals waiting on a person, for the console's inbox (migration 0017).
Index("approvals_pending_idx", approvals.c.expires_at,
      postgresql_where=text("granted_at IS NULL AND revoked_at IS NULL"))

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
    _ts("created_at", nullable=False, default_now=True),
    # The writing transaction's id (migration 0006): the relay reads the outbox as a log of
    # snapshot differences and never updates a row (see relay/claims.py).
    Column("xid", XID8, nullable=False, server_default=text("pg_current_xact_id()")),
)
# A run's messages, for its page in the console and `outbox runs show` (migration 0017).
Index("outbox_messages_run_idx", outbox_messages.c.run_id,
      postgresql_where=text("run_id IS NOT NULL"))
# A lane's rows in id order (the relay's read) and by transaction id (a snapshot difference).
Index("outbox_messages_lane_id_idx", outbox_messages.c.lane, outbox_messages.c.id)
Index(
    "outbox_messages_lane_xid_idx",
    outbox_messages.c.lane,
    outbox_messages.c.xid,
    postgresql_include=["id"],
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

# A consumer confirms a waiting run's effect inside its own transaction; the primary key makes
# a redelivered confirmation (same id) a no-op instead of a second move.
confirmations = Table(
    "confirmations",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), primary_key=True),
    Column("confirmation_id", Text, primary_key=True),
    Column("outcome", Text, nullable=False),
    Column("actor", Text, nullable=False),
    _ts("applied_at", nullable=False, default_now=True),
    Column("evidence", JSONB),  # migration 0008
    CheckConstraint("outcome IN ('running', 'done', 'failed')", name="confirmations_outcome_check"),
)

# Named signals a run is sent (migration 0012, outbox/runs/signals.py), kept until it takes them.
run_signals = Table(
    "run_signals",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), primary_key=True),
    Column("signal_id", Text, primary_key=True),
    Column("name", Text, nullable=False),
    Column("payload", JSONB),
    Column("sender", Text, nullable=False),
    _ts("sent_at", nullable=False, default_now=True),
    _ts("received_at"),
)
Index("run_signals_pending_idx", run_signals.c.run_id, run_signals.c.name,
      run_signals.c.sent_at, postgresql_where=text("received_at IS NULL"))

# The effects of a run that declared how to undo them (migration 0014,
# outbox/runs/compensation.py), in the order they were emitted.
run_effects = Table(
    "run_effects",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id"), nullable=False),
    Column("seq", BigInteger, primary_key=True, autoincrement=True),
    Column("message_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("type", Text, nullable=False),
    Column("compensation", JSONB, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'open'")),
    Column("evidence", JSONB),
    Column("compensation_id", UUID(as_uuid=True)),
    Column("compensation_evidence", JSONB),
    _ts("created_at", nullable=False, default_now=True),
    _ts("decided_at"),
    CheckConstraint("state IN ('open', 'compensating', 'compensated', 'not-applied', 'refused', "
                    "'kept')", name="run_effects_state_check"),
)
Index("run_effects_run_idx", run_effects.c.run_id, run_effects.c.seq)

# A run's events, numbered in commit order by triggers deferred to the commit (migration
# 0019, outbox/runs/events.py): references to their source rows, joined when read. No foreign
# key to agent_runs on purpose (the migration says why); retention deletes a purged run's.
RUN_EVENT_KINDS = ("state", "log", "effect_sent", "effect_confirmed", "approval_requested",
                   "approval_granted", "approval_revoked", "approval_spent")
run_events = Table(
    "run_events",
    metadata,
    Column("run_id", UUID(as_uuid=True), primary_key=True),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("kind", Text, nullable=False),
    Column("ref", BigInteger),
    Column("ref_key", Text),
    _ts("at", nullable=False, default_now=True),
    CheckConstraint("kind IN (" + ", ".join(f"'{k}'" for k in RUN_EVENT_KINDS) + ")",
                    name="run_events_kind_check"),
)
# Each run's last event number; its row lock orders the run's events by commit.
run_event_heads = Table(
    "run_event_heads",
    metadata,
    Column("run_id", UUID(as_uuid=True), primary_key=True),
    Column("seq", BigInteger, nullable=False),
)

# --- relay coordination (migration 0002) ---------------------------------------------------

# Which relay publishes which lane. Acquiring a lane bumps its token; a relay claims rows only
# while (owner, token) still match and the lease has not run out (see relay/lanes.py).
relay_lanes = Table(
    "relay_lanes",
    metadata,
    Column("lane", Integer, primary_key=True, autoincrement=False),
    Column("owner", Text),
    Column("token", BigInteger, nullable=False, server_default=text("0")),
    _ts("expires_at"),
    # The lane's cursor (migration 0006): every row whose transaction is visible in it was
    # published (or refused and recorded); a batch in several steps keeps its target snapshot
    # and the last id done. '3:3:' sees nothing but frozen rows.
    Column(
        "cursor_snapshot", PG_SNAPSHOT, nullable=False, server_default=text("'3:3:'::pg_snapshot")
    ),
    Column("batch_snapshot", PG_SNAPSHOT),
    Column("batch_pos", BigInteger, nullable=False, server_default=text("0")),
    Column("published_count", BigInteger, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    _ts("last_error_at"),
)

# The server's incarnation (migration 0010), an UNLOGGED table of one row: crash recovery and
# a standby's promotion empty it, so a relay's in-memory cursors (snapshots of transaction
# ids) are used only while it holds the incarnation they were read under (relay/history.py).
relay_server = Table(
    "relay_server",
    metadata,
    Column("one", Boolean, primary_key=True, server_default=text("true")),
    Column("incarnation", UUID(as_uuid=True), nullable=False,
           server_default=text("gen_random_uuid()")),
    _ts("since", nullable=False, default_now=True),
    CheckConstraint("one", name="relay_server_one_row"),
    prefixes=["UNLOGGED"],
)

# Workers waiting for runs (migration 0011): the runs' wake-ups NOTIFY only while some row's
# idle_until is in the future (outbox/runs/wakeups.py), so commits pay NOTIFY's lock only then.
run_workers = Table(
    "run_workers",
    metadata,
    Column("worker", Text, primary_key=True),
    _ts("idle_until", nullable=False),
)

# Which cluster the outbox's transaction ids belong to (migration 0010): pg_control_system()'s
# identifier, one logged row that moves with the data; another cluster's means a restore or a
# move, and the relays refuse to read until `outbox relay rebase` (relay/history.py).
relay_history = Table(
    "relay_history",
    metadata,
    Column("one", Boolean, primary_key=True, server_default=text("true")),
    Column("system_identifier", BigInteger, nullable=False),
    _ts("since", nullable=False, default_now=True),
    CheckConstraint("one", name="relay_history_one_row"),
)

# The broker's proof, one row per lane per batch: ids with the partition and offset of each
# (migration 0006). The view published_messages unnests them.
deliveries = Table(
    "deliveries",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("lane", Integer, nullable=False),
    Column("relay_id", Text, nullable=False),
    Column("token", BigInteger, nullable=False),
    Column("first_id", BigInteger, nullable=False),
    Column("last_id", BigInteger, nullable=False),
    Column("ids", ARRAY(BigInteger), nullable=False),
    Column("partitions", ARRAY(Integer), nullable=False),
    Column("offsets", ARRAY(BigInteger), nullable=False),
    _ts("published_at", nullable=False, default_now=True),
)
Index(
    "deliveries_range_idx",
    func.int8range(deliveries.c.first_id, deliveries.c.last_id, literal_column("'[]'::text")),
    postgresql_using="gist",
)

# Refused messages, copied whole: dead-lettered, blocking their key, or held back behind one
# (migration 0006). An operator's retry sets state 'retry'; the relay publishes and deletes them.
FAILURE_STATES = ("failed", "held", "retry")
outbox_failures = Table(
    "outbox_failures",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("message_id", UUID(as_uuid=True), nullable=False),
    Column("topic", Text, nullable=False),
    Column("key", LargeBinary),
    Column("lane", Integer, nullable=False),
    Column("message_type", Text, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("run_id", UUID(as_uuid=True)),
    _ts("created_at", nullable=False),
    Column("state", Text, nullable=False),
    Column("blocking", Boolean, nullable=False, server_default=text("false")),
    Column("error", Text),
    _ts("failed_at", nullable=False, default_now=True),
    Column("dlq_partition", Integer),
    Column("dlq_offset", BigInteger),
    CheckConstraint("state IN ('failed', 'held', 'retry')", name="outbox_failures_state_check"),
)
Index(
    "outbox_failures_lane_idx",
    outbox_failures.c.lane,
    outbox_failures.c.topic,
    outbox_failures.c.key,
    outbox_failures.c.id,
)

# --- operations (migration 0004) -----------------------------------------------------------

OPERATION_STATUSES = ("pending", "unknown", "not-applied", "confirmed", "rejected", "needs-human")
OPERATION_ON_SETTLE = ("finish", "resume")

# The ledger of calls to outside systems (dedup/ledger/operations.py). The intent is committed
# before the call; an outcome we did not see stays open (pending/unknown) until a status query or a
# human establishes it, so a second call is never made blindly.
operations = Table(
    "operations",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("idempotency_key", Text, nullable=False, unique=True),
    Column("system", Text, nullable=False),
    Column("operation", Text, nullable=False),
    Column("message_id", Text),
    Column("run_id", UUID(as_uuid=True), ForeignKey("agent_runs.id")),
    Column("request_digest", Text, nullable=False),
    Column("request", JSONB),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("calls", Integer, nullable=False, server_default=text("0")),
    Column("checks", Integer, nullable=False, server_default=text("0")),
    Column("version", BigInteger, nullable=False, server_default=text("0")),
    Column("reference", Text),
    Column("response_digest", Text),
    Column("evidence", JSONB),
    Column("last_error", Text),
    _ts("next_check_at"),
    Column("resolved_by", Text),
    Column("resolution_reason", Text),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    _ts("resolved_at"),
    # What settling the operation does to its run: finish it (done/failed) or resume it
    # (running, for the worker's next claim). Migration 0005.
    Column("on_settle", Text, nullable=False, server_default=text("'finish'")),
    CheckConstraint(
        "status IN ('pending', 'unknown', 'not-applied', 'confirmed', 'rejected', 'needs-human')",
        name="operations_status_check",
    ),
    CheckConstraint("on_settle IN ('finish', 'resume')", name="operations_on_settle_check"),
)
# The reconciler scans only open operations that are due.
Index(
    "operations_due_idx",
    operations.c.next_check_at,
    postgresql_where=text("status IN ('pending', 'unknown', 'not-applied')"),
)
Index("operations_status_idx", operations.c.status, operations.c.created_at)
Index("operations_run_idx", operations.c.run_id, postgresql_where=text("run_id IS NOT NULL"))
Index("operations_message_idx", operations.c.message_id,  # migration 0014
      postgresql_where=text("message_id IS NOT NULL"))

# Each call, status query, retry, escalation and human resolution of an operation.
operation_events = Table(
    "operation_events",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("operation_id", UUID(as_uuid=True), ForeignKey("operations.id"), nullable=False),
    Column("kind", Text, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("detail", JSONB),
    Column("actor", Text),
    _ts("at", nullable=False, default_now=True),
    CheckConstraint(
        "kind IN ('intent', 'call', 'check', 'retry', 'escalation', 'resolution', "
        "'late-outcome')",
        name="operation_events_kind_check",
    ),
)
Index("operation_events_operation_idx", operation_events.c.operation_id, operation_events.c.id)

# --- consumers + dedup (migration 0003) ------------------------------------------------------

# The dedup (inbox) mark: written in the transaction of the handler's own writes, so a
# redelivered message finds it and is dropped. Its rows ARE the dedup window.
consumer_inbox = Table(
    "consumer_inbox",
    metadata,
    Column("consumer_group", Text, primary_key=True),
    Column("message_id", Text, primary_key=True),
    Column("topic", Text, nullable=False),
    Column("kafka_partition", Integer, nullable=False),
    Column("kafka_offset", BigInteger, nullable=False),
    _ts("processed_at", nullable=False, default_now=True),
)
Index(
    "consumer_inbox_processed_idx",
    consumer_inbox.c.consumer_group,
    consumer_inbox.c.processed_at,
)

# Messages a consumer could not handle: attempts (counted across crashes), the dead-letter
# copy, and replays. One row per (group, topic, partition, offset).
consumer_failures = Table(
    "consumer_failures",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("consumer_group", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("kafka_partition", Integer, nullable=False),
    Column("kafka_offset", BigInteger, nullable=False),
    Column("message_id", Text),
    Column("key", LargeBinary),
    Column("payload", LargeBinary),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text),
    Column("status", Text, nullable=False, server_default=text("'retrying'")),
    _ts("first_failed_at", nullable=False, default_now=True),
    _ts("last_failed_at", nullable=False, default_now=True),
    _ts("dead_lettered_at"),
    Column("dlq_topic", Text),
    Column("dlq_partition", Integer),
    Column("dlq_offset", BigInteger),
    _ts("replayed_at"),
    Column("discarded_by", Text),  # migration 0017
    Column("discard_reason", Text),  # migration 0017
    Column("replayed_by", Text),  # migration 0017
    CheckConstraint(
        "status IN ('retrying', 'recovered', 'dead-lettered', 'replayed', 'discarded')",
        name="consumer_failures_status_check",
    ),
    UniqueConstraint(
        "consumer_group",
        "topic",
        "kafka_partition",
        "kafka_offset",
        name="consumer_failures_position_key",
    ),
)
Index(
    "consumer_failures_status_idx",
    consumer_failures.c.consumer_group,
    consumer_failures.c.status,
    consumer_failures.c.id,
)
