"""The asyncio twin of outbox's API: same plans, same SQL, awaited on your connection.

One convention: the asyncio twin of ``outbox.X`` is ``outbox.aio.X``, same name, same
arguments, awaited; no other name says "async". Every function takes the caller's
``AsyncConnection`` or ``AsyncSession`` and **never commits** (except :func:`purge`, a
maintenance job that commits per batch, like its sync twin); see the sync functions in
:mod:`outbox.runs.lifecycle`, :mod:`outbox.runs.steps`, :mod:`outbox.runs.retry`,
:mod:`outbox.runs.approvals`, :mod:`outbox.runs.artifacts`, :mod:`outbox.runs.workflows`,
:mod:`outbox.messages.emit`, :mod:`outbox.runs.confirm` and :mod:`outbox.runs.retention` for what
each one does. """

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from outbox.db.execution import AsyncConn, driver_row_async, missing_schema, run_plan_async
from outbox.handle import CP, RunHandle, stored, transition_ends
from outbox.messages import compensations as compensations_
from outbox.messages.emit import _emit_async, _emit_many_async
from outbox.messages.envelope import Envelope
from outbox.runs import (
    approvals,
    artifacts,
    children,
    events,
    fencing,
    retry,
    runlog,
    signals,
    steps,
    workflows,
)
from outbox.runs import compensation as compensation_
from outbox.runs import lifecycle as runs
from outbox.runs.checkpoints import KEEP
from outbox.runs.confirm import Confirmation, Outcome, confirmation_plan, confirmations_plan
from outbox.runs.leases import Lease
from outbox.runs.retention import DEFAULT_STATES, Progress, purge_batch_plan, purgeable_plan
from outbox.runs.states import RunState
from outbox.runs.workflows import Workflow
from outbox.runtime.failpoints import failpoint
from outbox.settings import OutboxSettings

T = TypeVar("T")

__all__ = ["AsyncClaimedRun"]


async def start_run(conn: AsyncConn, *, workflow: str, workflow_version: str,
                    idempotency_key: str, checkpoint: Any = None,
                    prompt_version: str | None = None, tool_schema_version: str | None = None,
                    settings: OutboxSettings | None = None, notify: bool = True) -> runs.Run:
    """Async :func:`outbox.runs.lifecycle.start_run`."""
    return await run_plan_async(conn, runs.start_run_plan(
        workflow=workflow, workflow_version=workflow_version, idempotency_key=idempotency_key,
        checkpoint=checkpoint, prompt_version=prompt_version,
        tool_schema_version=tool_schema_version, settings=settings, notify=notify), settings)


async def claim(conn: AsyncConn, *, worker: str, lease_seconds: float,
                workflows: Sequence[str | Workflow] | None = None,
                settings: OutboxSettings | None = None) -> AsyncClaimedRun | None:
    """Async :func:`outbox.claim`: the claimed run's handle, or ``None``; never commits."""
    got = await run_plan_async(conn, runs.claim_plan(
        worker=worker, lease_seconds=lease_seconds, workflows=workflows, settings=settings),
        settings)
    return None if got is None else AsyncClaimedRun(conn, got.run, got.lease, settings=settings)


async def transition(conn: AsyncConn, lease: Lease, to: RunState | str, *,
                     step: str | None = None, reason: str | None = None, evidence: Any = None,
                     actor: str | None = None, checkpoint: Any = KEEP,
                     wake_at: datetime | timedelta | None = None,
                     settings: OutboxSettings | None = None,
                     log: runlog.Log | None = None) -> Lease:
    """Async :func:`outbox.runs.lifecycle.transition`."""
    return await run_plan_async(conn, runs.transition_plan(
        lease, to, step=step, reason=reason, evidence=evidence, actor=actor,
        checkpoint=checkpoint, wake_at=wake_at, settings=settings, log=log), settings)


async def save_checkpoint(conn: AsyncConn, lease: Lease, checkpoint: Any, *,
                          step: str | None = None, log: runlog.Log | None = None,
                          settings: OutboxSettings | None = None) -> Lease:
    """Async :func:`outbox.runs.lifecycle.save_checkpoint`: the same statement, awaited."""
    sql, params = runlog.save_statement(lease, checkpoint, step, log, settings)
    connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
    try:
        row = await driver_row_async(connection, sql, params)
    except ProgrammingError as exc:
        if (translated := missing_schema(exc, settings)) is None:
            raise
        raise translated from exc
    if (saved := runlog.saved_lease(lease, row)) is None:
        running = {RunState.RUNNING.value}
        await run_plan_async(
            conn, fencing.explain(lease.run_id, lease, RunState.RUNNING.value, running), settings)
        raise AssertionError("explain raises for a missed fenced write")  # pragma: no cover
    failpoint("outbox.after_checkpoint")
    return saved


async def read_log(conn: AsyncConn, run_id: uuid.UUID, *, upto: int | None = None,
                   settings: OutboxSettings | None = None) -> list[Any]:
    """Async :func:`outbox.runs.runlog.read_log`."""
    return await run_plan_async(conn, runlog.read_plan(run_id, upto), settings)


async def run_events(conn: AsyncConn, run_id: uuid.UUID, *, after: int = 0, limit: int = 100,
                     settings: OutboxSettings | None = None) -> list[events.RunEvent]:
    """Async :func:`outbox.runs.events.run_events`; reads only."""
    return await run_plan_async(conn, events.events_plan(run_id, after=after, limit=limit),
                                settings)


async def renew(conn: AsyncConn, lease: Lease, lease_seconds: float, *,
                settings: OutboxSettings | None = None) -> Lease:
    """Async :func:`outbox.runs.lifecycle.renew`."""
    return await run_plan_async(conn, runs.renew_plan(lease, lease_seconds), settings)


async def release(conn: AsyncConn, lease: Lease, *, reason: str | None = None,
                  settings: OutboxSettings | None = None) -> None:
    """Async :func:`outbox.runs.lifecycle.release`."""
    await run_plan_async(conn, runs.release_plan(lease, reason), settings)


async def move(conn: AsyncConn, run_id: uuid.UUID, to: RunState | str, *, actor: str,
               reason: str | None = None, evidence: Any = None,
               not_before: datetime | timedelta | None = None,
               settings: OutboxSettings | None = None, notify: bool = True) -> runs.Run:
    """Async :func:`outbox.runs.lifecycle.move`; ``notify=False`` for a transaction that will
    be prepared."""
    return await run_plan_async(conn, runs.move_plan(
        run_id, to, actor=actor, reason=reason, evidence=evidence, not_before=not_before,
        settings=settings, notify=notify), settings)


async def wake(conn: AsyncConn, run_id: uuid.UUID, *, at: datetime | timedelta | None = None,
               settings: OutboxSettings | None = None, notify: bool = True) -> runs.Run:
    """Async :func:`outbox.runs.lifecycle.wake`; ``notify=False`` for a transaction that will
    be prepared."""
    return await run_plan_async(conn, runs.wake_plan(run_id, at, settings, notify), settings)


async def get_run(conn: AsyncConn, run_id: uuid.UUID, *,
                  settings: OutboxSettings | None = None) -> runs.Run:
    """Async :func:`outbox.runs.lifecycle.get_run`."""
    return await run_plan_async(conn, runs.get_run_plan(run_id), settings)


async def history(conn: AsyncConn, run_id: uuid.UUID, *,
                  settings: OutboxSettings | None = None) -> list[runs.Transition]:
    """Async :func:`outbox.runs.lifecycle.history`."""
    return await run_plan_async(conn, runs.history_plan(run_id), settings)


async def recorded(conn: AsyncConn, run_id: uuid.UUID, step_key: str, *,
                   settings: OutboxSettings | None = None) -> steps.StepRecord | None:
    """Async :func:`outbox.runs.steps.recorded`."""
    return await run_plan_async(conn, steps.recorded_plan(run_id, step_key), settings)


async def record(conn: AsyncConn, lease: Lease, step_key: str, result: Any, *,
                 checkpoint: Any = KEEP, settings: OutboxSettings | None = None) -> Lease:
    """Async :func:`outbox.runs.steps.record`."""
    return await run_plan_async(
        conn, steps.record_plan(lease, step_key, result, checkpoint, settings), settings)


async def run_step(conn: AsyncConn, lease: Lease, step_key: str,
                   fn: Callable[[], Awaitable[T]], *, regenerable: bool = False,
                   checkpoint: Any = KEEP,
                   settings: OutboxSettings | None = None) -> steps.StepRun[T]:
    """Async :func:`outbox.runs.steps.run_step`: *fn* is a coroutine function."""
    if regenerable:
        return steps.StepRun(await fn(), lease, replayed=False)
    found = await run_plan_async(conn, steps.lookup_plan(lease, step_key), settings)
    if found is not None:
        value: T = found.result
        return steps.StepRun(value, lease, replayed=True)
    value = await fn()
    lease = await record(conn, lease, step_key, value, checkpoint=checkpoint, settings=settings)
    return steps.StepRun(value, lease, replayed=False)


async def handle_failure(conn: AsyncConn, lease: Lease, error: BaseException, *,
                         policy: retry.RetryPolicy, step: str | None = None,
                         rng: random.Random | None = None,
                         settings: OutboxSettings | None = None,
                         notify: bool = True) -> retry.RetryOutcome:
    """Async :func:`outbox.runs.retry.handle_failure`; ``notify=False`` for a transaction that
    will be prepared."""
    return await run_plan_async(
        conn, retry.handle_failure_plan(lease, error, policy, step, rng, settings=settings,
                                        notify=notify), settings)


async def store_artifact(conn: AsyncConn, content: bytes, *,
                         media_type: str = "application/octet-stream",
                         settings: OutboxSettings | None = None) -> artifacts.ArtifactRef:
    """Async :func:`outbox.runs.artifacts.store_artifact`."""
    return await run_plan_async(conn, artifacts.store_plan(content, media_type), settings)


async def load_artifact(conn: AsyncConn, ref: artifacts.ArtifactRef | str, *,
                        settings: OutboxSettings | None = None) -> bytes:
    """Async :func:`outbox.runs.artifacts.load_artifact`."""
    return await run_plan_async(conn, artifacts.load_plan(ref), settings)


async def request_approval(conn: AsyncConn, run_id: uuid.UUID, *, scope: Mapping[str, Any],
                           expires_at: datetime | timedelta, reason: str | None = None,
                           digest: str | None = None,
                           settings: OutboxSettings | None = None) -> approvals.Approval:
    """Async :func:`outbox.runs.approvals.request_approval`."""
    return await run_plan_async(
        conn, approvals.request_plan(run_id, scope, expires_at, reason, digest), settings)


async def grant(conn: AsyncConn, approval_id: uuid.UUID, *, by: str, reason: str | None = None,
                digest: str | None = None, settings: OutboxSettings | None = None,
                notify: bool = True) -> approvals.Approval:
    """Async :func:`outbox.runs.approvals.grant`."""
    return await run_plan_async(conn, approvals.grant_plan(
        approval_id, by, settings, notify, reason=reason, digest=digest), settings)


async def revoke(conn: AsyncConn, approval_id: uuid.UUID, *, by: str,
                 reason: str | None = None,
                 settings: OutboxSettings | None = None) -> approvals.Approval:
    """Async :func:`outbox.runs.approvals.revoke`."""
    return await run_plan_async(conn, approvals.revoke_plan(approval_id, by, reason), settings)


async def approvals_audit(conn: AsyncConn, *, run_id: uuid.UUID | None = None,
                          limit: int = 100, settings: OutboxSettings | None = None,
                          ) -> list[approvals.ApprovalAudit]:
    """Async :func:`outbox.runs.approvals.approvals_audit`; reads only."""
    return await run_plan_async(conn, approvals.audit_plan(run_id, limit), settings)


async def revalidate(conn: AsyncConn, lease: Lease, approval_id: uuid.UUID, *,
                     scope: Mapping[str, Any],
                     settings: OutboxSettings | None = None) -> approvals.ApprovalCheck:
    """Async :func:`outbox.runs.approvals.revalidate`."""
    return await run_plan_async(
        conn, approvals.revalidate_plan(lease, approval_id, scope, settings), settings)


async def register(conn: AsyncConn, workflow: Workflow, *,
                   settings: OutboxSettings | None = None) -> None:
    """Async :func:`outbox.runs.workflows.register`."""
    await run_plan_async(conn, workflows.register_plan(workflow), settings)


async def retire(conn: AsyncConn, name: str, *, reason: str,
                 settings: OutboxSettings | None = None) -> None:
    """Async :func:`outbox.runs.workflows.retire`."""
    await run_plan_async(conn, workflows.retire_plan(name, reason), settings)


async def emit(conn: AsyncConn, envelope: Envelope, *, lease: Lease | None = None,
               settings: OutboxSettings | None = None, notify: bool = True) -> uuid.UUID:
    """Async :func:`outbox.messages.emit.emit`; never commits."""
    # emit runs driver SQL, not a plan: its async body lives beside the sync one it mirrors.
    return await _emit_async(conn, envelope, lease=lease, settings=settings, notify=notify)


async def emit_many(conn: AsyncConn, envelopes: Sequence[Envelope], *,
                    lease: Lease | None = None, settings: OutboxSettings | None = None,
                    notify: bool = True) -> list[uuid.UUID]:
    """Async :func:`outbox.messages.emit.emit_many`; never commits."""
    return await _emit_many_async(conn, envelopes, lease=lease, settings=settings,
                                  notify=notify)


async def apply_confirmation(conn: AsyncConn, *, run_id: uuid.UUID,
                             confirmation_id: str | uuid.UUID, outcome: Outcome, evidence: Any,
                             actor: str, reason: str | None = None,
                             settings: OutboxSettings | None = None,
                             notify: bool = True) -> bool:
    """Async :func:`outbox.runs.confirm.apply_confirmation`; never commits. ``notify=False``
    for a transaction that will be prepared."""
    plan = confirmation_plan(run_id, str(confirmation_id), outcome=outcome, evidence=evidence,
                             actor=actor, reason=reason, settings=settings, notify=notify)
    return await run_plan_async(conn, plan, settings)


async def confirmations(conn: AsyncConn, run_id: uuid.UUID, *,
                        ids: Collection[str | uuid.UUID] | None = None,
                        settings: OutboxSettings | None = None) -> dict[str, Confirmation]:
    """Async :func:`outbox.runs.confirm.confirmations`."""
    return await run_plan_async(conn, confirmations_plan(run_id, ids), settings)


async def purge_batch(conn: AsyncConn, *, older_than: timedelta, batch_size: int = 100,
                      archive: bool = False, states: Collection[RunState | str] = DEFAULT_STATES,
                      settings: OutboxSettings | None = None) -> int:
    """Async :func:`outbox.runs.retention.purge_batch`; never commits."""
    return await run_plan_async(
        conn, purge_batch_plan(older_than, batch_size, archive, states), settings)


async def purgeable(conn: AsyncConn, *, older_than: timedelta,
                    states: Collection[RunState | str] = DEFAULT_STATES,
                    settings: OutboxSettings | None = None) -> int:
    """Async :func:`outbox.runs.retention.purgeable`; reads only."""
    return await run_plan_async(conn, purgeable_plan(older_than, states), settings)


async def purge(engine: AsyncEngine, *, older_than: timedelta, batch_size: int = 100,
                max_batches: int = 1000, archive: bool = False,
                states: Collection[RunState | str] = DEFAULT_STATES,
                settings: OutboxSettings | None = None,
                on_batch: Callable[[int], object] | None = None) -> int:
    """Async :func:`outbox.runs.retention.purge`: commits one transaction per batch."""
    progress = Progress(batch_size, on_batch)
    for _ in range(max_batches):
        async with engine.begin() as conn:
            done = await purge_batch(conn, older_than=older_than, batch_size=batch_size,
                                     archive=archive, states=states, settings=settings)
        if not progress.more_after(done):
            break
    return progress.total


class AsyncClaimedRun(RunHandle[AsyncConn, CP]):
    """Async :class:`outbox.handle.ClaimedRun`: same methods, awaited; never commits."""

    async def transition(self, to: RunState | str, *, step: str | None = None,
                         reason: str | None = None, evidence: Any = None,
                         actor: str | None = None, checkpoint: Any = KEEP,
                         wake_at: datetime | timedelta | None = None,
                         log: runlog.Log | None = None) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.transition`; it ends the lease."""
        lease = await transition(self.conn, self._held(), to, step=step, reason=reason,
                                 evidence=evidence, actor=actor, checkpoint=stored(checkpoint),
                                 wake_at=wake_at, settings=self.settings, log=log)
        self._kept(lease, ends=transition_ends(to))

    async def save_checkpoint(self, checkpoint: Any, *, step: str | None = None,
                              log: runlog.Log | None = None) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.save_checkpoint`."""
        self._kept(await save_checkpoint(self.conn, self._held(), stored(checkpoint), step=step,
                                         log=log, settings=self.settings))

    async def renew(self, lease_seconds: float) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.renew`."""
        self._kept(await renew(self.conn, self._held(), lease_seconds, settings=self.settings))

    async def release(self, *, reason: str | None = None) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.release`; it ends the lease."""
        await release(self.conn, self._held(), reason=reason, settings=self.settings)
        self._ended_by = "release()"

    async def record(self, step_key: str, result: Any, *, checkpoint: Any = KEEP) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.record`."""
        self._kept(await record(self.conn, self._held(), step_key, result,
                                checkpoint=stored(checkpoint), settings=self.settings))

    async def run_step(self, step_key: str, fn: Callable[[], Awaitable[T]], *,
                       regenerable: bool = False, checkpoint: Any = KEEP) -> steps.StepRun[T]:
        """Async :meth:`outbox.handle.ClaimedRun.run_step`: *fn* is a coroutine function."""
        done = await run_step(self.conn, self._held(), step_key, fn, regenerable=regenerable,
                              checkpoint=stored(checkpoint), settings=self.settings)
        self._kept(done.lease)
        return done

    async def handle_failure(self, error: BaseException, *, policy: retry.RetryPolicy,
                             step: str | None = None, rng: random.Random | None = None,
                             notify: bool = True) -> retry.RetryOutcome:
        """Async :meth:`outbox.handle.ClaimedRun.handle_failure`; it ends the lease."""
        outcome = await handle_failure(self.conn, self._held(), error, policy=policy,
                                       step=step, rng=rng, settings=self.settings,
                                       notify=notify)
        self._kept(outcome.lease, ends=f"handle_failure(), which moved the run to "
                                       f"{outcome.state.value!r}")
        return outcome

    async def revalidate(self, approval_id: uuid.UUID, *,
                         scope: Mapping[str, Any]) -> approvals.ApprovalCheck:
        """Async :meth:`outbox.handle.ClaimedRun.revalidate`."""
        check = await revalidate(self.conn, self._held(), approval_id, scope=scope,
                                 settings=self.settings)
        return self._after_check(check, approval_id)

    async def spend_approval(self, approval_id: uuid.UUID, *, digest: str,
                             message_id: uuid.UUID) -> approvals.Approval:
        """Async :meth:`outbox.handle.ClaimedRun.spend_approval`."""
        return await run_plan_async(self.conn, approvals.spend_plan(
            approval_id, digest=digest, message_id=message_id, lease=self._held()),
            self.settings)

    async def receive(self, name: str) -> signals.Signal | None:
        """Async :meth:`outbox.handle.ClaimedRun.receive`."""
        return await run_plan_async(self.conn, signals.receive_plan(self._held(), name),
                                    self.settings)

    async def wait_for_signal(self, *names: str, until: datetime | timedelta | None = None,
                              step: str | None = None, reason: str | None = None,
                              actor: str | None = None, checkpoint: Any = KEEP) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.wait_for_signal`; it ends the lease."""
        lease = await run_plan_async(self.conn, signals.wait_plan(
            self._held(), names, until=until, step=step, reason=reason, actor=actor,
            settings=self.settings, checkpoint=stored(checkpoint)), self.settings)
        self._kept(lease, ends=transition_ends(RunState.WAITING))

    async def wait_for_children(self, join: children.Join = "all", *,
                                until: datetime | timedelta | None = None,
                                step: str | None = None, reason: str | None = None,
                                actor: str | None = None, checkpoint: Any = KEEP,
                                fail_fast: bool = False,
                                on_failure: children.OnFailure | None = None) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.wait_for_children`; it ends the lease."""
        lease = await run_plan_async(self.conn, children.wait_plan(
            self._held(), join, until=until, step=step, reason=reason, actor=actor,
            settings=self.settings, checkpoint=stored(checkpoint), fail_fast=fail_fast,
            on_failure=on_failure),
            self.settings)
        self._kept(lease, ends=transition_ends(RunState.WAITING))

    async def children(self) -> list[runs.Run]:
        """Async :meth:`outbox.handle.ClaimedRun.children`."""
        return await run_plan_async(self.conn, children.children_plan(self.run.id),
                                    self.settings)

    async def emit(self, envelope: Envelope, *, compensation: Envelope | None = None,
                   notify: bool = True) -> uuid.UUID:
        """Async :meth:`outbox.handle.ClaimedRun.emit`."""
        if compensation is not None:
            return await run_plan_async(self.conn, compensations_.record_plan(
                self._held(), envelope, compensation, self.settings, notify), self.settings)
        return await emit(self.conn, envelope, lease=self._held(), settings=self.settings,
                          notify=notify)

    async def compensate(self, *, reason: str, evidence: Any = None, actor: str | None = None,
                         checkpoint: Any = KEEP) -> None:
        """Async :meth:`outbox.handle.ClaimedRun.compensate`; it ends the lease."""
        self._kept(await run_plan_async(self.conn, self._compensate_plan(
            reason, evidence, actor, stored(checkpoint)), self.settings), ends="compensate()")

    async def effects(self) -> list[compensation_.Effect]:
        """Async :meth:`outbox.handle.ClaimedRun.effects`."""
        return await run_plan_async(self.conn, compensation_.effects_plan(self.run.id),
                                    self.settings)

    async def emit_many(self, envelopes: Sequence[Envelope], *,
                        compensations: Sequence[Envelope | None] | None = None,
                        notify: bool = True) -> list[uuid.UUID]:
        """Async :meth:`outbox.handle.ClaimedRun.emit_many`."""
        specs = compensations_.undos(envelopes, compensations, self.settings)
        ids = await emit_many(self.conn, envelopes, lease=self._held(), settings=self.settings,
                              notify=notify)
        await run_plan_async(self.conn, compensations_.recorded_many(
            self._held(), ids, envelopes, specs), self.settings)
        return ids
