"""One step of a claimed run, in the worker's transaction model.

The claim committed in its own transaction. The step function then runs in a second one,
on a handle that starts from the claim's lease; the worker commits it. If the function
returned and the handle still holds the lease, the worker moves the run to ``done`` in
that same transaction (the function's writes and the move commit together). If it raised,
that transaction is rolled back and, in a new one, the workflow's retry policy for the
run's step decides (:func:`outbox.runs.retry.handle_failure`): requeued with backoff, or
given up. :class:`~outbox.errors.LeaseLost`: another worker owns the run now; nothing of the
step committed, and the step is dropped. :class:`~outbox.errors.LeaseSpent` (the function
wrote after ending its own lease) is a bug in the function, not a lost race: the lease is
still this worker's once the step rolled back, so it fails the run like any final error
(dropping it would replay the same step after every lease expiry). A lost database
connection drops the step too (the lease expires and the run is claimed again); the worker
waits the outage out.
"""

from __future__ import annotations

import logging
from typing import Literal

import psycopg
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.aio import AsyncClaimedRun
from outbox.app import Step
from outbox.errors import LeaseLost
from outbox.handle import ClaimedRun
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import Run
from outbox.runs.retry import RetryOutcome
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)

Outcome = Literal["done", "moved", "retried", "gave_up", "lease_lost", "db_unavailable",
                  "error"]
"""How a step ended (the ``outcome`` label of ``outboxkit_worker_steps_total``): ``done`` the
function returned and the worker finished the run; ``moved`` the function moved it itself;
``retried`` / ``gave_up`` it raised and the retry policy requeued / gave up; ``lease_lost``
dropped; ``db_unavailable`` dropped for a database outage; ``error`` the failure could not
be recorded either (its lease expires)."""

# SQLSTATE classes of a server that went away: connection exceptions and shutdowns.
_GONE = ("08", "57P01", "57P02", "57P03")


def is_outage(exc: BaseException) -> bool:
    """True when *exc* says the database cannot be reached (not that a statement failed)."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig if exc.orig is not None else exc
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        state = getattr(exc, "sqlstate", None)
        return state is None or state.startswith(_GONE)
    return False


def _done_evidence(step: Step) -> dict[str, str]:
    return {"returned": step.name}


def _failed(step: Step, run: Run, exc: BaseException, outcome: RetryOutcome) -> Outcome:
    retried = outcome.state is RunState.QUEUED
    log.warning("run %s (%s) step %s raised %s: %s; %s", run.id, step.name, run.step,
                type(exc).__name__, str(exc)[:200],
                f"retry in {outcome.delay:.1f} s (attempt {outcome.attempts})" if retried
                else f"gave up: now {outcome.state.value}",
                extra={"event": "worker.step_retried" if retried else "worker.step_gave_up",
                       "run_id": str(run.id), "workflow": step.name})
    return "retried" if retried else "gave_up"


def _dropped(step: Step, run: Run, exc: BaseException) -> Outcome:
    if is_outage(exc):
        log.debug("run %s dropped: database unavailable", run.id)
        return "db_unavailable"
    if isinstance(exc, LeaseLost):
        log.warning("run %s (%s): %s; nothing of this step committed, dropped", run.id,
                    step.name, exc, extra={"event": "worker.lease_lost", "run_id": str(run.id),
                                          "workflow": step.name})
        return "lease_lost"
    log.error("run %s (%s): recording its failure failed too (%s: %s); its lease expires",
              run.id, step.name, type(exc).__name__, exc,
              extra={"event": "worker.step_error", "run_id": str(run.id), "workflow": step.name})
    return "error"


def run_sync(step: Step, run: Run, lease: Lease, engine: Engine, *,
             settings: OutboxSettings, actor: str) -> Outcome:
    """Run a sync step function in a transaction of its own, then finish or fail the run."""
    try:
        checkpoint = step.load(run)
        with engine.begin() as conn:
            job: ClaimedRun = ClaimedRun(conn, run, lease, settings=settings,
                                         checkpoint=checkpoint)
            step.fn(job)
            if job.spent:
                return "moved"
            job.transition(RunState.DONE, reason="the step function returned",
                           evidence=_done_evidence(step), actor=actor)
            return "done"
    except Exception as exc:
        if is_outage(exc) or isinstance(exc, LeaseLost):
            return _dropped(step, run, exc)
        try:
            with engine.begin() as conn:
                outcome = ClaimedRun(conn, run, lease, settings=settings).handle_failure(
                    exc, policy=step.workflow.retry_for(run.step), step=run.step)
        except Exception as second:
            return _dropped(step, run, second)
        return _failed(step, run, exc, outcome)


async def run_async(step: Step, run: Run, lease: Lease, engine: AsyncEngine, *,
                    settings: OutboxSettings, actor: str) -> Outcome:
    """:func:`run_sync` for an ``async def`` step function, on an ``AsyncEngine``."""
    try:
        checkpoint = step.load(run)
        async with engine.begin() as conn:
            job: AsyncClaimedRun = AsyncClaimedRun(conn, run, lease, settings=settings,
                                                   checkpoint=checkpoint)
            await step.fn(job)
            if job.spent:
                return "moved"
            await job.transition(RunState.DONE, reason="the step function returned",
                                 evidence=_done_evidence(step), actor=actor)
            return "done"
    except Exception as exc:
        if is_outage(exc) or isinstance(exc, LeaseLost):
            return _dropped(step, run, exc)
        try:
            async with engine.begin() as conn:
                outcome = await AsyncClaimedRun(conn, run, lease, settings=settings
                                                ).handle_failure(
                    exc, policy=step.workflow.retry_for(run.step), step=run.step)
        except Exception as second:
            return _dropped(step, run, second)
        return _failed(step, run, exc, outcome)
