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

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Literal

import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.aio import AsyncClaimedRun
from outbox.app import Step
from outbox.db.execution import run_plan, run_plan_async
from outbox.errors import LeaseLost
from outbox.handle import ClaimedRun
from outbox.messages import compensations
from outbox.runs import children
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import Run
from outbox.runs.retry import RetryOutcome, RetryPolicy
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)

Outcome = Literal["done", "moved", "retried", "caught", "gave_up", "compensating",
                  "lease_lost", "db_unavailable", "error"]
"""How a step ended (the ``outcome`` label of ``outboxkit_worker_steps_total``): ``done`` the
function returned and the worker finished the run; ``moved`` the function moved it itself;
``retried`` / ``caught`` / ``gave_up`` it raised and the retry policy requeued it / sent it
to its catch step / gave up; ``compensating`` the run undoes its effects (a turn of its
compensation, or it gave up with effects to undo); ``lease_lost``
dropped; ``db_unavailable`` dropped for a database outage; ``error`` the failure could not
be recorded either (its lease expires)."""

# SQLSTATE classes of a server that went away: connection exceptions and shutdowns.
_GONE = ("08", "57P01", "57P02", "57P03")
# A server that cannot take writes now: read-only (a failover not finished, a demoted
# primary) or a statement cancelled by its timeout. Waited out like an outage.
_BUSY = ("25006", "57014")


def is_outage(exc: BaseException) -> bool:
    """True when *exc* says the database cannot be reached (not that a statement failed).

    Only for errors of the worker's own statements (claims, the failure's record): a step
    function's errors are judged by the step's connection (:func:`run_sync`), since it may
    talk to other databases."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig if exc.orig is not None else exc
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        state = getattr(exc, "sqlstate", None)
        return state is None or state.startswith(_GONE)
    return False


def is_unavailable(exc: BaseException) -> bool:
    """:func:`is_outage`, or the server refused for now (read-only, statement timeout)."""
    if is_outage(exc):
        return True
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    return getattr(orig, "sqlstate", None) in _BUSY


def _lost(broke: bool | None, exc: BaseException) -> bool:
    """True when the database went away under the step: judged by the step's own connection
    (*broke*: invalidated when the function's part raised), not by the exception's type, for
    a psycopg ``OperationalError`` from another database the function talks to is the step's
    failure, for its retry policy. Outside the function's part (connecting, the commit:
    *broke* ``None``) only the worker's own statements ran: their error says it."""
    return is_outage(exc) if broke is None else broke


UNDOING = RetryPolicy(max_attempts=10, initial_backoff=1.0, max_backoff=60.0)
"""How a failed turn of a compensating run is retried, whatever the workflow's policy (its
``catch`` steps belong to the workflow's code, which an undoing does not run). It then goes
to a person (:func:`outbox.runs.retry.handle_failure` never fails a compensating run)."""


def _policy(step: Step, run: Run) -> RetryPolicy:
    return UNDOING if run.compensating_since is not None else step.workflow.retry_for(run.step)


def _done_evidence(step: Step) -> dict[str, str]:
    return {"returned": step.name}


def _failed(step: Step, run: Run, exc: BaseException, outcome: RetryOutcome) -> Outcome:
    retried = outcome.state is RunState.QUEUED
    ended: Outcome
    if outcome.compensating:
        then, event, ended = ("gave up: compensating its effects", "worker.step_compensating",
                              "compensating")
    elif outcome.caught is not None:
        then, event, ended = (f"caught: goes on at step {outcome.caught!r}",
                              "worker.step_caught", "caught")
    elif retried:
        then, event, ended = (f"retry in {outcome.delay:.1f} s (attempt {outcome.attempts})",
                              "worker.step_retried", "retried")
    else:
        then, event, ended = (f"gave up: now {outcome.state.value}", "worker.step_gave_up",
                              "gave_up")
    log.warning("run %s (%s) step %s raised %s: %s; %s", run.id, step.name, run.step,
                type(exc).__name__, str(exc)[:200], then,
                extra={"event": event, "run_id": str(run.id), "workflow": step.name})
    return ended


def _dropped(step: Step, run: Run, exc: BaseException, *, lost: bool = False) -> Outcome:
    if lost or is_outage(exc):
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


@contextlib.contextmanager
def _transaction(engine: Engine, conn: Connection | None) -> Iterator[Connection]:
    """A transaction on *conn* (the claim's connection, kept for the step: no second pool
    checkout), or on a connection of *engine* when there is none or it was invalidated."""
    if conn is None or conn.invalidated:
        with engine.begin() as fresh:
            yield fresh
    else:
        with conn.begin():
            yield conn


def run_sync(step: Step, run: Run, lease: Lease, engine: Engine, *,
             settings: OutboxSettings, actor: str, conn: Connection | None = None) -> Outcome:
    """Run a sync step function in a transaction of its own, then finish or fail the run.

    *conn*: a connection of *engine* to run the transactions on (the worker's, which claimed
    the run on it), not in a transaction. Any exception of the function is its failure,
    ``SystemExit`` and ``KeyboardInterrupt`` too (a library calling ``sys.exit``): recorded by
    the retry policy, never the worker's end.
    """
    broke: bool | None = None
    try:
        if run.compensating_since is not None:  # the run undoes its effects, not its steps
            with _transaction(engine, conn) as tx:
                run_plan(tx, compensations.step_plan(lease, actor=actor, settings=settings),
                         settings)
            return "compensating"
        if run.on_child_failure is not None:  # its join declared what a failed child does
            with _transaction(engine, conn) as tx:
                if run_plan(tx, children.failure_plan(lease, run, actor=actor,
                                                      settings=settings), settings):
                    return "moved"
        checkpoint = step.load(run)
        with _transaction(engine, conn) as tx:
            job: ClaimedRun = ClaimedRun(tx, run, lease, settings=settings,
                                         checkpoint=checkpoint)
            try:
                step.fn(job)
                ended: Outcome = "moved" if job.spent else "done"
                if not job.spent:
                    job.transition(RunState.DONE, reason="the step function returned",
                                   evidence=_done_evidence(step), actor=actor)
            except BaseException:
                broke = tx.invalidated  # read before the rollback closes it
                raise
    except BaseException as exc:
        if (lost := _lost(broke, exc)) or isinstance(exc, LeaseLost):
            return _dropped(step, run, exc, lost=lost)
        try:
            with _transaction(engine, conn) as tx:
                outcome = ClaimedRun(tx, run, lease, settings=settings).handle_failure(
                    exc, policy=_policy(step, run), step=run.step)
        except Exception as second:
            return _dropped(step, run, second)
        return _failed(step, run, exc, outcome)
    if run.parent_id is not None and ended == "moved":
        try:
            with _transaction(engine, conn) as tx:
                run_plan(tx, children.orphan_plan(run.id, actor=actor, settings=settings),
                         settings)
        except Exception as exc:  # the step committed: only its parent's cancel is late
            _orphan_unchecked(run, exc)
    return ended


def _orphan_unchecked(run: Run, exc: BaseException) -> None:
    log.warning("run %s: whether its parent %s failed during the step was not checked "
                "(%s: %s); a cancel of the parent moves it later", run.id, run.parent_id,
                type(exc).__name__, exc, extra={"event": "worker.orphan_unchecked"})


async def run_async(step: Step, run: Run, lease: Lease, engine: AsyncEngine, *,
                    settings: OutboxSettings, actor: str) -> Outcome:
    """:func:`run_sync` for an ``async def`` step function, on an ``AsyncEngine``; only a
    cancellation (the worker abandoning it at shutdown) is not the step's failure."""
    broke: bool | None = None
    try:
        if run.compensating_since is not None:
            await _compensate_async(run, lease, engine, settings=settings, actor=actor)
            return "compensating"
        if run.on_child_failure is not None and await _child_failed_async(
                run, lease, engine, settings=settings, actor=actor):
            return "moved"
        checkpoint = step.load(run)
        async with engine.begin() as conn:
            job: AsyncClaimedRun = AsyncClaimedRun(conn, run, lease, settings=settings,
                                                   checkpoint=checkpoint)
            try:
                await step.fn(job)
                ended: Outcome = "moved" if job.spent else "done"
                if not job.spent:
                    await job.transition(RunState.DONE, reason="the step function returned",
                                         evidence=_done_evidence(step), actor=actor)
            except BaseException:
                broke = conn.invalidated  # read before the rollback closes it
                raise
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        return await _failed_async(step, run, lease, engine, exc, settings=settings,
                                   lost=_lost(broke, exc))
    if run.parent_id is not None and ended == "moved":
        try:
            async with engine.begin() as conn:
                await run_plan_async(conn, children.orphan_plan(
                    run.id, actor=actor, settings=settings), settings)
        except Exception as exc:  # the step committed: only its parent's cancel is late
            _orphan_unchecked(run, exc)
    return ended


_DRIVEN: dict[RunState, Outcome] = {RunState.DONE: "done", RunState.RUNNING: "lease_lost",
                                    RunState.QUEUED: "retried", RunState.FAILED: "gave_up"}


async def run_driven(step: Step, run: Run, lease: Lease, engine: AsyncEngine, *,
                     settings: OutboxSettings) -> Outcome:
    """A :class:`~outbox.app.Driven` workflow's turn (a durable agent's): it commits as it
    goes and records its own failures; what escapes it (its failure's record failing too, a
    database outage) is handled as :func:`run_async`'s."""
    try:
        if run.compensating_since is not None:
            await _compensate_async(run, lease, engine, settings=settings, actor=lease.owner)
            return "compensating"
        if run.on_child_failure is not None and await _child_failed_async(
                run, lease, engine, settings=settings, actor=lease.owner):
            return "moved"
        state = await step.fn(engine, run, lease, settings=settings)
        return _DRIVEN.get(state, "moved")
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        return await _failed_async(step, run, lease, engine, exc, settings=settings,
                                   lost=is_outage(exc))


async def _compensate_async(run: Run, lease: Lease, engine: AsyncEngine, *,
                            settings: OutboxSettings, actor: str) -> None:
    """A compensating run's turn (:func:`outbox.messages.compensations.step_plan`)."""
    async with engine.begin() as conn:
        await run_plan_async(conn, compensations.step_plan(lease, actor=actor,
                                                           settings=settings), settings)


async def _child_failed_async(run: Run, lease: Lease, engine: AsyncEngine, *,
                              settings: OutboxSettings, actor: str) -> bool:
    """:func:`outbox.runs.children.failure_plan`: True if a failed child moved the run."""
    async with engine.begin() as conn:
        return await run_plan_async(conn, children.failure_plan(
            lease, run, actor=actor, settings=settings), settings) is not None


async def _failed_async(step: Step, run: Run, lease: Lease, engine: AsyncEngine,
                        exc: BaseException, *, settings: OutboxSettings, lost: bool) -> Outcome:
    if lost or isinstance(exc, LeaseLost):
        return _dropped(step, run, exc, lost=lost)
    try:
        async with engine.begin() as conn:
            outcome = await AsyncClaimedRun(conn, run, lease, settings=settings
                                            ).handle_failure(
                exc, policy=_policy(step, run), step=run.step)
    except Exception as second:
        return _dropped(step, run, second)
    return _failed(step, run, exc, outcome)
