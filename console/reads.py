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
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    tuple_,
)

from consumers.failures import FailedMessage, list_failures
from dedup.ledger.ledger import Ledger
from dedup.ledger.operations import Operation, OperationEvent
from outbox.db.queries import quote_identifier, sql
from outbox.db.tables import agent_runs, approvals, consumer_failures, operations
from outbox.messages.backlog import Message, list_messages, run_messages
from outbox.runs.approvals import Approval, list_approvals
from outbox.runs.lifecycle import Run, RunView, Transition, history, view_run
from outbox.runs.runlog import read_log
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings
from relay.status import RelayInfo, read_relays

# The backlog is counted up to this many rows per lane (as the relay's own gauge does).
BACKLOG_CAP = 100_000
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
    """Run states whose count is the planner's estimate (``done``, on a big table)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def overview(conn: Connection, settings: OutboxSettings, *, lease_seconds: float) -> Overview:
    """Counts of everything an operator watches: four cheap statements (indexed groupings,
    the relay's capped backlog), never a pass over the outbox's history."""
    by_state, estimated = run_counts(conn, settings)
    ops: dict[str, int] = {status: n for status, n in conn.execute(
        select(operations.c.status, func.count()).group_by(operations.c.status))}
    pending = conn.execute(select(func.count()).select_from(approvals).where(
        *_pending_approval())).scalar_one()
    failures: dict[str, int] = {status: n for status, n in conn.execute(
        select(consumer_failures.c.status, func.count())
        .where(consumer_failures.c.status.in_(("retrying", "dead-lettered")))
        .group_by(consumer_failures.c.status))}
    backlog = conn.execute(sql("relay", "backlog", settings.schema_name),
                           {"cap": BACKLOG_CAP, "lanes": settings.lanes}).one()
    relays, unowned = read_relays(conn, settings.schema_name,
                                         lease_seconds=lease_seconds)
    return Overview(by_state, ops, pending, int(backlog.backlog),
                    float(backlog.oldest_age or 0), int(backlog.failed), failures,
                    relays, unowned, estimated)


# Above this many runs (the planner's estimate), "done" is estimated, not counted: a count
# of a million finished runs is ~120 ms each refresh, everything else a few ms.
EXACT_UP_TO = 100_000
UNFINISHED = tuple(s.value for s in RunState if s is not RunState.DONE)


def run_counts(conn: Connection, settings: OutboxSettings) -> tuple[dict[str, int], list[str]]:
    """Runs by state; on a big table, the finished ones (most of it) from the planner's row
    estimate, the others counted exactly by the state index (what an operator acts on)."""
    r = agent_runs
    total = conn.execute(select(func.greatest(literal_column("reltuples"), 0))
                         .select_from(text("pg_class"))
                         .where(literal_column("oid") == func.to_regclass(literal(
                             f"{quote_identifier(settings.schema_name)}.agent_runs")))
                         ).scalar() or 0
    exact = total <= EXACT_UP_TO
    query = select(r.c.state, func.count()).where(r.c.purged_at.is_(None))
    if not exact:
        query = query.where(r.c.state.in_(UNFINISHED))
    counts = dict.fromkeys((s.value for s in RunState), 0)
    for state, n in conn.execute(query.group_by(r.c.state)):
        counts[state] = n
    if exact:
        return counts, []
    counts[RunState.DONE.value] = max(int(total) - sum(counts.values()), 0)
    return counts, [RunState.DONE.value]


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


def runs_page(conn: Connection, *, state: str | None = None, workflow: str | None = None,
              search: str | None = None, before: str | None = None,
              limit: int = 50) -> RunsPage:
    """Runs newest first, *limit* at a time, after the cursor *before* (keyset, not OFFSET:
    a deep page costs what the first does). *search* matches the start of the idempotency
    key or the run id, or a word of the step or the reason."""
    r = agent_runs
    query = select(r).where(r.c.purged_at.is_(None))
    if state:
        query = query.where(r.c.state == RunState(state).value)
    if workflow:
        query = query.where(r.c.workflow == workflow)
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


def messages_page(conn: Connection, settings: OutboxSettings, *, failures: str,
                  limit: int = 50) -> MessagesPage:
    """Refused outbox rows (the relay gave up on them) and consumers' failures of *failures*
    status (dead-lettered by default), oldest first."""
    return MessagesPage(list_messages(conn, status="failed", limit=limit, settings=settings),
                        list_failures(conn, status=failures, limit=limit))


def operation_of(conn: Connection, op_id: uuid.UUID) -> Operation | None:
    row = conn.execute(select(operations).where(operations.c.id == op_id)).mappings().first()
    return None if row is None else Operation.from_row(row)


def approval_of(conn: Connection, approval_id: uuid.UUID) -> Approval | None:
    row = conn.execute(select(approvals).where(and_(approvals.c.id == approval_id))
                       ).mappings().first()
    return None if row is None else Approval.from_row(row)
