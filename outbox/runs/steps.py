"""Step results recorded once, so a resumed run replays them instead of calling again.

A step's result is written under ``(run_id, step_key)`` by the lease holder, fenced like
every run write, in the caller's transaction: commit it together with the transition or
checkpoint it leads to. On resume :func:`run_step` returns the recorded result and does not
call the model or tool again. *Regenerable* steps (cheap, side-effect free) are neither
recorded nor replayed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from sqlalchemy import CTE, Insert, exists, insert, literal, select

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import agent_runs, step_results
from outbox.errors import (
    ConfigurationError,
    IllegalTransition,
    LeaseLost,
    RunNotFound,
    StepAlreadyRecorded,
)
from outbox.runs import fencing
from outbox.runs.checkpoints import KEEP, Keep, bounded, checkpoint_value, json_value
from outbox.runs.leases import Lease
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

T = TypeVar("T")


@dataclass(frozen=True)
class StepRecord:
    """A recorded step result."""

    run_id: uuid.UUID
    step_key: str
    result: Any
    recorded_at: datetime


@dataclass(frozen=True)
class StepRun(Generic[T]):
    """What :func:`run_step` returns: the value, the lease to keep writing with, and whether
    the value was replayed from the record (the call was not made again)."""

    value: T
    lease: Lease
    replayed: bool


def recorded_plan(run_id: uuid.UUID, step_key: str) -> Plan[StepRecord | None]:
    s = step_results
    rows = yield select(s).where(s.c.run_id == run_id, s.c.step_key == step_key)
    return StepRecord(**dict(rows[0])) if rows else None


def lookup_plan(lease: Lease, step_key: str) -> Plan[StepRecord | None]:
    """The recorded result, after checking *lease* still holds (so a worker that lost the
    run does not call the model or tool again only to be refused when recording)."""
    r = agent_runs
    rows = yield select(r.c.lease_token, r.c.version, r.c.state).where(r.c.id == lease.run_id)
    if not rows:
        raise RunNotFound(lease.run_id)
    row = rows[0]
    if (row["lease_token"], row["version"]) != (lease.token, lease.version):
        raise LeaseLost(lease.run_id, lease.token)
    if row["state"] != RunState.RUNNING:
        raise IllegalTransition(lease.run_id, row["state"], RunState.RUNNING.value,
                                "steps run only while the run is running")
    return (yield from recorded_plan(lease.run_id, step_key))


def record_plan(lease: Lease, step_key: str, result: Any, checkpoint: Any,
                settings: OutboxSettings | None) -> Plan[Lease]:
    if not step_key:
        raise ConfigurationError("step_key must be a non-empty string")
    bounded(result, settings)
    values: dict[str, Any] = {"step": step_key, "attempts": 0}  # progress resets the attempts
    if not isinstance(checkpoint, Keep):
        values["checkpoint"] = checkpoint_value(checkpoint, settings)
    not_recorded = ~exists(select(step_results.c.step_key).where(
        step_results.c.run_id == agent_runs.c.id, step_results.c.step_key == step_key))

    def insert_result(moved: CTE) -> Insert:
        return insert(step_results).from_select(
            ["run_id", "step_key", "result"],
            select(moved.c.id, literal(step_key), json_value(result)),
        )

    running = {RunState.RUNNING.value}
    stmt = fencing.statement(lease.run_id, lease=lease, sources=running, values=values,
                             where=[not_recorded], also=insert_result)
    row = yield from fencing.write(stmt, lease.run_id, lease, RunState.RUNNING, running)
    if row is None:
        raise StepAlreadyRecorded(lease.run_id, step_key)
    return fencing.next_lease(lease, row)


def recorded(conn: SyncConn, run_id: uuid.UUID, step_key: str, *,
             settings: OutboxSettings | None = None) -> StepRecord | None:
    """The recorded result of *step_key*, or ``None`` if the step has not completed."""
    return run_plan(conn, recorded_plan(run_id, step_key), settings)


def record(conn: SyncConn, lease: Lease, step_key: str, result: Any, *,
           checkpoint: Any = KEEP, settings: OutboxSettings | None = None) -> Lease:
    """Record *result* (JSON) as *step_key*'s outcome, fenced by *lease*; never commits.

    Sets the run's step to *step_key* (and its checkpoint, when given) in the same
    statement. Raises :class:`LeaseLost` (nothing written) or :class:`StepAlreadyRecorded`.
    """
    return run_plan(conn, record_plan(lease, step_key, result, checkpoint, settings), settings)


def run_step(
    conn: SyncConn,
    lease: Lease,
    step_key: str,
    fn: Callable[[], T],
    *,
    regenerable: bool = False,
    checkpoint: Any = KEEP,
    settings: OutboxSettings | None = None,
) -> StepRun[T]:
    """Return *step_key*'s recorded result, or call *fn* once and record what it returns.

    Never commits: commit after it (with the transition it leads to) to confirm the step.
    Checks the lease before calling *fn* (:class:`LeaseLost` if the run was taken over).
    ``regenerable=True`` always calls *fn* and records nothing.
    """
    if regenerable:
        return StepRun(fn(), lease, replayed=False)
    found = run_plan(conn, lookup_plan(lease, step_key), settings)
    if found is not None:
        value: T = found.result
        return StepRun(value, lease, replayed=True)
    value = fn()
    lease = record(conn, lease, step_key, value, checkpoint=checkpoint, settings=settings)
    return StepRun(value, lease, replayed=False)
