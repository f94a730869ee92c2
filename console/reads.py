"""What the console's pages show, read through the library where it has the read (a run, its
history, messages, approvals, operations, the relays' status) and here where only the
console asks (counts for the overview, the runs list by keyset, the inbox).

Every list is bounded: the runs list pages by keyset on ``(created_at, id)`` (migration
0017), the others show the newest/oldest ``limit`` rows with a count of the rest.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    func,
    literal,
    or_,
    select,
    text,
    tuple_,
)

from consumers.failures import FailedMessage, failure_groups, list_failures
from dedup.ledger.ledger import Ledger
from dedup.ledger.operations import Operation, OperationEvent
from outbox.db.tables import (
    OPERATION_STATUSES,
    agent_runs,
    approvals,
    confirmations,
    consumer_failures,
    operations,
    outbox_failures,
)
from outbox.kafka.api import Admin
from outbox.messages.backlog import Message, list_messages, run_messages
from outbox.runs.approvals import Approval, list_approvals
from outbox.runs.lifecycle import Run, RunView, Transition, history, view_run
from outbox.runs.runlog import read_log
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings
from relay.metrics import read_backlog
from relay.status import RelayInfo, read_relays

NEEDS_A_PERSON = ("needs-human", "unknown")
"""Operation statuses in the inbox: a person must decide (needs-human), or may (unknown:
the reconciler is still asking the outside system; a person who knows can settle it)."""


class BadCursor(ValueError):
    """A ``before`` value no page of this console wrote."""


@dataclass(frozen=True)
class Overview:
    runs: dict[str, int]
    operations: dict[str, int]
    approvals_pending: int
    backlog: int
    oldest_pending_age_s: float
    failed_messages: int
    consumer_failures: dict[str, int]
    relays: list[RelayInfo] = field(default_factory=list)
    unowned_lanes: list[int] = field(default_factory=list)
    estimated: list[str] = field(default_factory=list)
    """Run states whose count is the planner's estimate (``done``, ``failed``, on a big
    table)."""
    operations_estimated: list[str] = field(default_factory=list)
    """Likewise for operations (``confirmed``, ``rejected``)."""
    parked: list[dict[str, Any]] = field(default_factory=list)
    """Partitions (batch mode) or keys (per-message) a group holds a message of for a retry."""
    backlog_by_topic: list[dict[str, Any]] = field(default_factory=list)
    """The backlog by lane and topic; past the capped read of a lane, one more entry without
    a topic, ``estimated``."""
    backlog_estimated: bool = False
    """Whether :attr:`backlog` holds an estimate (a lane's backlog past the capped read)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def overview(conn: Connection, settings: OutboxSettings, *, lease_seconds: float) -> Overview:
    """Counts of everything an operator watches: four cheap statements (indexed groupings,
    the relay's capped backlog), never a pass over the outbox's history."""
    by_state, estimated = counts_by(conn, settings, agent_runs.c.state,
                                    (s.value for s in RunState),
                                    (agent_runs.c.purged_at.is_(None),))
    ops, ops_estimated = counts_by(conn, settings, operations.c.status, OPERATION_STATUSES)
    pending = conn.execute(select(func.count()).select_from(approvals).where(
        *_pending_approval())).scalar_one()
    failures: dict[str, int] = {status: n for status, n in conn.execute(
        select(consumer_failures.c.status, func.count())
        .where(consumer_failures.c.status.in_(("retrying", "dead-lettered")))
        .group_by(consumer_failures.c.status))}
    # One read of the backlog (by lane and topic), as the relay's gauges read it: the
    # total, the oldest age and the refused rows from it.
    driver = conn.connection.driver_connection  # psycopg's, in this same transaction
    assert driver is not None  # a connection in use has one
    backlog = read_backlog(driver, settings.schema_name, lanes=settings.lanes)
    by_topic = [{"lane": r.lane, "topic": r.topic, "messages": r.n, "oldest": r.oldest,
                 "estimated": r.estimated} for r in backlog.by_topic]
    relays, unowned = read_relays(conn, settings.schema_name, lease_seconds=lease_seconds)
    return Overview(by_state, ops, pending, backlog.backlog, backlog.oldest_age, backlog.failed,
                    failures, relays, unowned, estimated, ops_estimated, parked(conn), by_topic,
                    backlog.estimated)


# Above this many rows (the planner's estimate), the states that only grow with history
# (finished runs, settled operations) come from the planner's statistics instead of a count:
# counting a million finished runs took ~120 ms a refresh; the states an operator acts on
# are few and always counted exactly, by index.
EXACT_UP_TO = 100_000
HISTORY = {"agent_runs": ("done", "failed"), "operations": ("confirmed", "rejected")}


def counts_by(conn: Connection, settings: OutboxSettings, column: Any,
              states: Iterable[str], where: Sequence[Any] = ()) -> tuple[dict[str, int],
                                                                        list[str]]:
    """Rows of *column*'s table by *column*'s value (every one of *states* present, 0 if
    none), and which of them are estimates: on a big table the history states are the
    table's row estimate times the value's frequency in ``pg_stats`` (as of the last
    ANALYZE, which autovacuum keeps recent)."""
    table = column.table
    counts = dict.fromkeys(states, 0)
    history = HISTORY.get(table.name, ())
    estimates = _estimates(conn, settings, table.name, column.name) if history else None
    query = select(column, func.count()).where(*where)
    if estimates is not None:
        # The others by name (IN, not NOT IN): an index range each, not a pass over all.
        query = query.where(column.in_([v for v in counts if v not in history]))
    for value, n in conn.execute(query.group_by(column)):
        counts[value] = n
    if estimates is None:
        return counts, []
    for value in history:
        counts[value] = estimates.get(value, 0)
    return counts, list(history)


def _estimates(conn: Connection, settings: OutboxSettings, table: str,
               column: str) -> dict[str, int] | None:
    """Rows per value from the planner's statistics; ``None`` for a small or unanalysed
    table (then counting is cheap, or the only way)."""
    rows = conn.execute(text(
        "SELECT c.reltuples, v.value, v.freq FROM pg_class AS c "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "JOIN pg_stats AS s ON s.schemaname = n.nspname AND s.tablename = c.relname "
        "CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs) "
        "    AS v(value, freq) "
        "WHERE n.nspname = :schema AND c.relname = :table AND s.attname = :column"),
        {"schema": settings.schema_name, "table": table, "column": column}).all()
    if not rows or rows[0].reltuples <= EXACT_UP_TO:
        return None
    return {row.value: round(row.reltuples * row.freq) for row in rows}


def _pending_approval() -> list[Any]:
    a = approvals
    return [a.c.granted_at.is_(None), a.c.revoked_at.is_(None), a.c.expires_at > func.now()]


# --- runs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunsPage:
    runs: list[Run]
    next_cursor: str | None  # the ``before`` of the next (older) page; None: the last page


def encode_cursor(created_at: datetime, run_id: uuid.UUID) -> str:
    raw = f"{created_at.isoformat()}|{run_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        when, _, run_id = raw.partition("|")
        return datetime.fromisoformat(when), uuid.UUID(run_id)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise BadCursor(f"'before' is not a cursor of this console: {cursor[:40]!r}") from exc


AGES = {"1h": timedelta(hours=1), "1d": timedelta(days=1), "7d": timedelta(days=7),
        "30d": timedelta(days=30)}
"""The runs list's age filter: started within the last ..."""


def runs_page(conn: Connection, *, state: str | None = None, workflow: str | None = None,
              version: str | None = None, age: str | None = None, search: str | None = None,
              before: str | None = None, limit: int = 50) -> RunsPage:
    """Runs newest first, *limit* at a time, after the cursor *before* (keyset, not OFFSET:
    a deep page costs what the first does); of *workflow* (and *version*), started within
    *age* (a key of :data:`AGES`). *search* matches the start of the idempotency key or
    the run id, or a word of the step or the reason."""
    r = agent_runs
    query = select(r).where(r.c.purged_at.is_(None))
    if state:
        query = query.where(r.c.state == RunState(state).value)
    if workflow:
        query = query.where(r.c.workflow == workflow)
    if version:
        query = query.where(r.c.workflow_version == version)
    if age:
        if age not in AGES:
            raise ValueError(f"age {age!r} is not one of {', '.join(AGES)}")
        query = query.where(r.c.created_at > func.now() - AGES[age])
    if search:
        like = _escape_like(search)
        matches: list[Any] = [r.c.idempotency_key.like(like + "%", escape="\\"),
                              r.c.step.ilike("%" + like + "%", escape="\\"),
                              r.c.reason.ilike("%" + like + "%", escape="\\")]
        with contextlib.suppress(ValueError):  # a whole run id: that run too
            matches.append(r.c.id == uuid.UUID(search.strip()))
        query = query.where(or_(*matches))
    if before:
        when, run_id = decode_cursor(before)
        query = query.where(tuple_(r.c.created_at, r.c.id) < tuple_(literal(when),
                                                                      literal(run_id)))
    rows = conn.execute(query.order_by(r.c.created_at.desc(), r.c.id.desc())
                        .limit(limit + 1)).mappings().all()
    found = [Run.from_row(row) for row in rows[:limit]]
    more = len(rows) > limit
    return RunsPage(found, encode_cursor(found[-1].created_at, found[-1].id)
                    if more and found else None)


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


@dataclass(frozen=True)
class RunPage:
    view: RunView
    transitions: list[Transition]
    messages: list[Message]
    operations: list[tuple[Operation, list[OperationEvent]]]
    approvals: list[Approval]
    children: list[Run]
    log: list[Any]
    confirmations: list[dict[str, Any]] = field(default_factory=list)
    """What consumers confirmed of the run's effects (outbox.runs.confirm), in order."""


def run_page(conn: Connection, run_id: uuid.UUID, settings: OutboxSettings) -> RunPage:
    """Everything about one run (``RunNotFound`` if there is none)."""
    view = view_run(conn, run_id, settings=settings)
    ledger = Ledger(settings=settings)
    ops = [Operation.from_row(row) for row in conn.execute(
        select(operations).where(operations.c.run_id == run_id)
        .order_by(operations.c.created_at)).mappings()]
    children = [Run.from_row(row) for row in conn.execute(
        select(agent_runs).where(agent_runs.c.parent_id == run_id)
        .order_by(agent_runs.c.created_at).limit(200)).mappings()]
    return RunPage(
        view=view,
        transitions=history(conn, run_id, settings=settings),
        messages=run_messages(conn, run_id, settings=settings),
        operations=[(op, ledger.history(conn, op.id)) for op in ops],
        approvals=list_approvals(conn, run_id=run_id, limit=100, settings=settings),
        children=children,
        log=read_log(conn, run_id, settings=settings),
        confirmations=[dict(r._mapping) for r in conn.execute(
            select(confirmations).where(confirmations.c.run_id == run_id)
            .order_by(confirmations.c.applied_at).limit(200))],
    )


# --- the inbox and the messages -------------------------------------------------------------


@dataclass(frozen=True)
class Inbox:
    operations: list[tuple[Operation, list[OperationEvent]]]
    runs: list[Run]
    approvals: list[Approval]


def inbox(conn: Connection, settings: OutboxSettings, *, limit: int = 50) -> Inbox:
    """What waits on a person, oldest first: operations whose outcome nobody established,
    runs in needs-human, approvals pending (not yet expired)."""
    ledger = Ledger(settings=settings)
    ops = [Operation.from_row(row) for row in conn.execute(
        select(operations).where(operations.c.status.in_(NEEDS_A_PERSON))
        .order_by(operations.c.status, operations.c.created_at).limit(limit)).mappings()]
    runs = [Run.from_row(row) for row in conn.execute(
        select(agent_runs).where(agent_runs.c.state == RunState.NEEDS_HUMAN.value,
                                 agent_runs.c.purged_at.is_(None))
        .order_by(agent_runs.c.created_at, agent_runs.c.id).limit(limit)).mappings()]
    pending = [Approval.from_row(row) for row in conn.execute(
        select(approvals).where(*_pending_approval())
        .order_by(approvals.c.expires_at).limit(limit)).mappings()]
    return Inbox([(op, ledger.history(conn, op.id)) for op in ops], runs, pending)


@dataclass(frozen=True)
class MessagesPage:
    refused: list[Message]
    consumer_failures: list[FailedMessage]
    groups: list[dict[str, Any]]
    """The failures of that status by group, topic and first line of the error."""
    waiting: list[dict[str, Any]] = field(default_factory=list)
    """Outbox rows held back behind a refused one of their key, or being retried."""


def messages_page(conn: Connection, settings: OutboxSettings, *, failures: str,
                  limit: int = 50) -> MessagesPage:
    """Refused outbox rows (the relay gave up on them) and consumers' failures of *failures*
    status (dead-lettered by default), oldest first."""
    f = outbox_failures
    waiting = [dict(r._mapping) for r in conn.execute(
        select(f.c.id, f.c.topic, f.c.key, f.c.state, f.c.run_id, f.c.failed_at)
        .where(f.c.state.in_(("held", "retry"))).order_by(f.c.id).limit(limit))]
    for row in waiting:
        row["key"] = None if row["key"] is None else bytes(row["key"]).decode(
            "utf-8", "backslashreplace")
    return MessagesPage(list_messages(conn, status="failed", limit=limit, settings=settings),
                        list_failures(conn, status=failures, limit=limit),
                        failure_groups(conn, status=failures), waiting)


def operation_of(conn: Connection, op_id: uuid.UUID) -> Operation | None:
    row = conn.execute(select(operations).where(operations.c.id == op_id)).mappings().first()
    return None if row is None else Operation.from_row(row)


def approval_of(conn: Connection, approval_id: uuid.UUID) -> Approval | None:
    row = conn.execute(select(approvals).where(and_(approvals.c.id == approval_id))
                       ).mappings().first()
    return None if row is None else Approval.from_row(row)


# --- consumers' lag (Kafka) -----------------------------------------------------------------


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    committed: int
    end: int

    @property
    def lag(self) -> int:
        return max(self.end - self.committed, 0)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lag": self.lag}


@dataclass(frozen=True)
class GroupLag:
    group: str
    partitions: list[PartitionLag]

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "lag": self.lag,
                "partitions": [p.as_dict() for p in self.partitions]}


MAX_GROUPS = 500


def consumer_lag(admin: Admin, groups: Iterable[str] | None = None) -> list[GroupLag]:
    """Each consumer group's lag per partition it committed: the partition's end offset
    minus where the group resumes, the groups most behind first (of at most
    :data:`MAX_GROUPS`, by name). A group's offsets on a topic deleted since are left out
    (its end offset cannot be asked), not the whole table."""
    names = sorted(groups) if groups is not None else admin.consumer_groups()
    topics = admin.list_topics()
    found = []
    for name in names[:MAX_GROUPS]:
        committed = {tp: o for tp, o in admin.committed_offsets(name).items()
                     if tp.topic in topics}
        ends = admin.end_offsets(list(committed), timeout_s=5.0) if committed else {}
        found.append(GroupLag(name, [
            PartitionLag(tp.topic, tp.partition, offset, ends.get(tp, offset))
            for tp, offset in sorted(committed.items())]))
    return sorted(found, key=lambda g: (-g.lag, g.group))


def parked(conn: Connection) -> list[dict[str, Any]]:
    """Partitions a consumer group holds a message of for a retry (batch mode parks the
    partition; per-message mode only that key): group, topic, partition, messages, since."""
    f = consumer_failures
    rows = conn.execute(
        select(f.c.consumer_group, f.c.topic, f.c.kafka_partition, func.count().label("n"),
               func.min(f.c.first_failed_at).label("since"))
        .where(f.c.status == "retrying")
        .group_by(f.c.consumer_group, f.c.topic, f.c.kafka_partition)
        .order_by(f.c.consumer_group, f.c.topic, f.c.kafka_partition).limit(200)).all()
    return [{"group": r.consumer_group, "topic": r.topic, "partition": r.kafka_partition,
             "messages": r.n, "since": r.since} for r in rows]
