"""An operator's requeue: a failed or needs-human run goes back to the queue, unless one of
its outside operations has no settled outcome.

The guard is why this is more than ``move(..., "queued")``: the run's worker would decide
again and could place the same order a second time (a new message, a new key) while the
first one's outcome is still to be learnt. ``outbox runs requeue`` and the console both
call :func:`requeue`, so both refuse the same thing with the same words.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import operations
from outbox.errors import IllegalTransition
from outbox.runs.lifecycle import Run, get_run_plan, move_plan
from outbox.runs.states import RunState, sources
from outbox.settings import OutboxSettings

UNSETTLED = ("pending", "unknown", "not-applied", "needs-human")


@dataclass(frozen=True)
class Unsettled:
    """An outside operation of the run whose outcome nobody knows yet."""

    id: uuid.UUID
    what: str
    status: str


def unsettled_plan(run_id: uuid.UUID) -> Plan[list[Unsettled]]:
    ops = operations
    rows = yield (select(ops.c.id, ops.c.operation, ops.c.system, ops.c.status)
                  .where(ops.c.run_id == run_id, ops.c.status.in_(UNSETTLED))
                  .order_by(ops.c.created_at))
    return [Unsettled(r["id"], f"{r['operation']} on {r['system']}", r["status"]) for r in rows]


def requeue_plan(run_id: uuid.UUID, *, reason: str, actor: str, force: bool = False,
                 settings: OutboxSettings | None = None) -> Plan[tuple[RunState, Run]]:
    if not reason.strip():
        raise ValueError("a requeue needs a reason: why the run can go again")
    before = (yield from get_run_plan(run_id)).state
    allowed = sorted(s.value for s in sources(RunState.QUEUED))
    if before.value not in allowed:
        raise IllegalTransition(
            run_id, before.value, RunState.QUEUED.value,
            f"run {run_id} is {before.value!r}; only a run that is "
            f"{' or '.join(allowed)} can be requeued")
    unsettled = [] if force else (yield from unsettled_plan(run_id))
    if unsettled:
        first = unsettled[0]
        raise IllegalTransition(
            run_id, before.value, RunState.QUEUED.value,
            f"run {run_id} has operation {first.id} ({first.what}) that is still "
            f"{first.status}: settle it (`outbox ops resolve {first.id}`, which settles the "
            f"run too), or force the requeue if its worker must decide again anyway")
    after = yield from move_plan(run_id, RunState.QUEUED, actor=actor, reason=reason,
                                 evidence=None, not_before=None, settings=settings)
    return before, after


def requeue(conn: SyncConn, run_id: uuid.UUID, *, reason: str, actor: str, force: bool = False,
            settings: OutboxSettings | None = None) -> tuple[RunState, Run]:
    """Put a failed or needs-human run back in the queue (attempts reset); never commits.
    Returns its state before and the run after. Refuses (``IllegalTransition``, nothing
    written) a run in another state, or one with an unsettled operation unless *force*."""
    return run_plan(conn, requeue_plan(run_id, reason=reason, actor=actor, force=force,
                                       settings=settings), settings)
