"""Retry policy, decided outside the model: how often, how long to wait, where to give up.

The model never chooses to retry. :func:`handle_failure` classifies the exception with the
step's :class:`RetryPolicy` and, in one fenced statement, either requeues the run
(``running → failed → queued``, two history rows, ``attempts + 1``,
``not_before = now() + backoff``) or moves it to the policy's terminal state with the error
as evidence. Attempts are bounded by ``max_attempts``; nothing loops.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select

from outbox.backoff import POLICY_NAMES, Backoff
from outbox.backoff import check as check_backoff
from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import agent_runs
from outbox.errors import ConfigurationError, LeaseLost, RunError, RunNotFound
from outbox.runs import compensation, fencing, wakeups
from outbox.runs.leases import Lease
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

_TERMINAL = (RunState.FAILED, RunState.NEEDS_HUMAN)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a failing step is retried. Errors that are neither *final* nor *retryable* are
    treated as final; outboxkit's own :class:`RunError`s are always final."""

    max_attempts: int = 3
    initial_backoff: float = 1.0
    multiplier: float = 2.0
    max_backoff: float = 300.0
    jitter: float = 0.1
    """Fraction (0..1) taken off the delay at random, so retries of many runs spread out."""
    retryable: tuple[type[BaseException], ...] = (Exception,)
    final: tuple[type[BaseException], ...] = ()
    give_up_state: RunState = RunState.FAILED
    """Where the run goes when attempts are exhausted or the error is final."""
    catch: Mapping[type[BaseException], str] = field(default_factory=dict)
    """Instead of giving up, go on at another step: for the first of these error types the
    error is an instance of, the run is queued again at that step (attempts from zero), the
    error as its evidence (``job.run.last_evidence``), as Step Functions' Catch follows its
    Retry. Not applied to outboxkit's own run errors (:class:`RunError`), in a retired workflow, nor
    when the failing step is that step already (a fallback that fails gives up)."""

    def __post_init__(self) -> None:
        for kind, target in self.catch.items():
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise ConfigurationError(f"catch keys are exception types, got {kind!r}")
            if not isinstance(target, str) or not target:
                raise ConfigurationError(
                    f"catch[{kind.__name__}] must name the step to go on at, got {target!r}")
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be >= 1, got {self.max_attempts}")
        check_backoff(self.initial_backoff, self.multiplier, self.max_backoff, self.jitter,
                      POLICY_NAMES)
        if RunState(self.give_up_state) not in _TERMINAL:
            raise ConfigurationError(
                f"give_up_state must be 'failed' or 'needs-human', got {self.give_up_state!r}"
            )

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number *attempt* (1-based)."""
        return self.schedule.delay(attempt, rng)

    @property
    def schedule(self) -> Backoff:
        """The delays as a :class:`Backoff`."""
        return Backoff(base=self.initial_backoff, factor=self.multiplier, cap=self.max_backoff,
                       jitter=self.jitter)

    def caught(self, error: BaseException, step: str | None) -> str | None:
        """The step *error* sends the run to instead of giving up (``None``: give up)."""
        if isinstance(error, RunError):
            return None
        for kind, target in self.catch.items():
            if isinstance(error, kind):
                return None if target == step else target
        return None

    def is_retryable(self, error: BaseException) -> bool:
        """True when *error* may be retried (final types win over retryable ones)."""
        if isinstance(error, (RunError, *self.final)):
            return False
        return isinstance(error, self.retryable)


@dataclass(frozen=True)
class RetryOutcome:
    """What :func:`handle_failure` did: the run's new state, the attempt it counted and,
    when requeued, the backoff delay. ``lease`` is spent either way: stop working."""

    state: RunState
    attempts: int
    delay: float | None
    lease: Lease
    caught: str | None = None
    """The step the run goes on at, when the policy's ``catch`` took the error."""
    compensating: bool = False
    """True when the run gave up with effects to undo: it now compensates
    (:mod:`outbox.runs.compensation`) and ends ``failed`` after that."""


def _evidence(error: BaseException, attempt: int, retryable: bool) -> dict[str, Any]:
    return {"error": type(error).__name__, "message": str(error)[:2000], "attempt": attempt,
            "retryable": retryable}


def handle_failure_plan(
    lease: Lease, error: BaseException, policy: RetryPolicy, step: str | None,
    rng: random.Random | None, *, settings: OutboxSettings | None = None, notify: bool = True,
) -> Plan[RetryOutcome]:
    runs = agent_runs
    rows = yield select(runs.c.attempts, runs.c.lease_token, runs.c.version,
                        runs.c.compensating_since, compensation.undecided().label("undecided"),
                        fencing.retired_clause().label("retired")).where(runs.c.id == lease.run_id)
    if not rows:
        raise RunNotFound(lease.run_id)
    row = rows[0]
    if (row["lease_token"], row["version"]) != (lease.token, lease.version):
        raise LeaseLost(lease.run_id, lease.token)
    attempt = row["attempts"] + 1
    retryable = policy.is_retryable(error)
    evidence = _evidence(error, attempt, retryable)
    described = f"{type(error).__name__}: {error}"[:500]
    sources: Collection[str] = {RunState.RUNNING}
    # A retired workflow's runs are not retried, but its undoing is (it runs none of its code).
    retired = row["retired"] and row["compensating_since"] is None
    if retryable and attempt < policy.max_attempts and not retired:
        delay = policy.backoff(attempt, rng)
        history = [
            fencing.HistoryRow(RunState.FAILED, reason=f"attempt {attempt} of "
                               f"{policy.max_attempts} failed: {described}",
                               evidence=evidence, step=step, actor=lease.owner),
            fencing.HistoryRow(RunState.QUEUED, from_state=RunState.FAILED,
                               reason=f"retry {attempt + 1} of {policy.max_attempts} after "
                               f"{delay:.3f}s backoff",
                               evidence={"attempt": attempt + 1, "delay_seconds": delay},
                               step=step, actor="retry-policy"),
        ]
        values = {"state": RunState.QUEUED.value, "attempts": attempt,
                  "not_before": func.now() + timedelta(seconds=delay),
                  "reason": history[0].reason, "last_evidence": evidence,
                  "finished_at": None, **fencing.lease_values(clear=True)}
        # The wake-up makes idle workers look again at when the next run is due.
        stmt = fencing.statement(lease.run_id, lease=lease, sources=sources, values=values,
                                 history=history,
                                 woken=wakeups.woken(settings) if notify else None)
        moved = yield from fencing.write(stmt, lease.run_id, lease, RunState.QUEUED, sources)
        assert moved is not None
        return RetryOutcome(RunState.QUEUED, attempt, delay, fencing.next_lease(lease, moved))
    caught = None if row["retired"] else policy.caught(error, step)
    if caught is not None:
        return (yield from _catch_plan(lease, caught, attempt=attempt, evidence=evidence,
                                       described=described, step=step, settings=settings,
                                       notify=notify))
    target = RunState(policy.give_up_state)
    if target is RunState.FAILED and row["undecided"] and row["compensating_since"] is None:
        # Its effects are undone first; the run ends failed after that.
        undoing = yield from compensation.begin_leased_plan(
            lease, reason=f"attempt {attempt} failed for good: {described}", evidence=evidence,
            actor=lease.owner, step=step, settings=settings, notify=notify)
        return RetryOutcome(RunState.QUEUED, attempt, None, undoing, compensating=True)
    if target is RunState.FAILED and row["compensating_since"] is not None:
        target = RunState.NEEDS_HUMAN  # failed would leave its effects half undone
    if not retryable:
        reason = f"final error on attempt {attempt}: {described}"
    elif row["retired"]:
        reason = f"attempt {attempt} failed and the workflow is retired: {described}"
    else:
        reason = f"gave up after {attempt} of {policy.max_attempts} attempts: {described}"
    values = {"state": target.value, "attempts": attempt, "reason": reason,
              "last_evidence": evidence, **fencing.lease_values(clear=True)}
    if target is RunState.FAILED:
        values["finished_at"] = func.now()
    stmt = fencing.statement(
        lease.run_id, lease=lease, sources=sources, values=values,
        history=[fencing.HistoryRow(target, reason=reason, evidence=evidence, step=step,
                                    actor=lease.owner)],
    )
    moved = yield from fencing.write(stmt, lease.run_id, lease, target, sources)
    assert moved is not None
    return RetryOutcome(target, attempt, None, fencing.next_lease(lease, moved))


def _catch_plan(lease: Lease, caught: str, *, attempt: int, evidence: dict[str, Any],
                described: str, step: str | None, settings: OutboxSettings | None,
                notify: bool) -> Plan[RetryOutcome]:
    """Queue the run again at step *caught*, attempts from zero, the error as evidence."""
    sources: Collection[str] = {RunState.RUNNING}
    reason = f"caught on attempt {attempt}: {described}"
    evidence = {**evidence, "caught_at": step, "continues_at": caught}
    history = [
        fencing.HistoryRow(RunState.FAILED, reason=reason, evidence=evidence, step=step,
                           actor=lease.owner),
        fencing.HistoryRow(RunState.QUEUED, from_state=RunState.FAILED,
                           reason=f"goes on at step {caught!r}", evidence=evidence,
                           step=caught, actor="retry-policy"),
    ]
    values = {"state": RunState.QUEUED.value, "step": caught, "attempts": 0,
              "not_before": None, "reason": reason, "last_evidence": evidence,
              "finished_at": None, **fencing.lease_values(clear=True)}
    stmt = fencing.statement(lease.run_id, lease=lease, sources=sources, values=values,
                             history=history, woken=wakeups.woken(settings) if notify else None)
    moved = yield from fencing.write(stmt, lease.run_id, lease, RunState.QUEUED, sources)
    assert moved is not None
    return RetryOutcome(RunState.QUEUED, attempt, 0.0, fencing.next_lease(lease, moved),
                        caught=caught)


def handle_failure(
    conn: SyncConn,
    lease: Lease,
    error: BaseException,
    *,
    policy: RetryPolicy,
    step: str | None = None,
    rng: random.Random | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> RetryOutcome:
    """Requeue the run with backoff, or move it to ``policy.give_up_state``; never commits.

    Call it from the ``except`` block of a failed step, in a *fresh* transaction (the
    failed one may be aborted), then commit. Raises :class:`LeaseLost` if another worker
    owns the run: then nothing was written. A requeue wakes an idle worker at commit;
    ``notify=False`` for a transaction that will be prepared (no NOTIFY).
    """
    return run_plan(conn, handle_failure_plan(lease, error, policy, step, rng, settings=settings,
                                              notify=notify), settings)
