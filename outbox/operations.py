"""What an :class:`~outbox.App` does outside a lease, with its settings bound once.

Each operation takes the caller's ``Connection`` / ``Session`` and **never commits** (except
:meth:`Operations.migrate` and :meth:`Operations.purge`, which run their own transactions);
``X_async`` is the same on an ``AsyncConnection`` / ``AsyncSession``. Writes under a lease
go through the handle a claim returns (:class:`~outbox.ClaimedRun`), never through these.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio
from outbox.db import migrate as migrations
from outbox.db.execution import AsyncConn, SyncConn, run_plan, run_plan_async
from outbox.handle import ClaimedRun, claim
from outbox.messages import emit as emitting
from outbox.messages.envelope import Envelope
from outbox.runs import (
    approvals,
    artifacts,
    children,
    compensation,
    confirm,
    events,
    lifecycle,
    retention,
    runlog,
    steps,
)
from outbox.runs.confirm import Confirmation, Outcome
from outbox.runs.lifecycle import Run, Transition
from outbox.runs.states import RunState
from outbox.runs.workflows import Workflow, retire
from outbox.settings import OutboxSettings, default_settings


class Operations:
    """Run and message operations bound to :attr:`settings` (the base of :class:`~outbox.App`)."""

    def __init__(self, *, settings: OutboxSettings | None = None) -> None:
        self._settings = settings

    @property
    def settings(self) -> OutboxSettings:
        """The settings every operation uses (default: from the environment)."""
        return self._settings or default_settings()

    # -- runs -------------------------------------------------------------------------------

    def claim(self, conn: SyncConn, *, worker: str, lease_seconds: float,
              workflows: Sequence[str | Workflow] | None = None) -> ClaimedRun[Any] | None:
        """Lease one runnable run to *worker* and return its handle, or ``None``.

        What ``outbox worker`` does for each step, for a loop of your own. Commit promptly:
        the run's row stays locked until then. *workflows*: only these (default: any);
        :class:`Workflow` objects apply their version policy to runs pinned elsewhere.
        """
        return claim(conn, worker=worker, lease_seconds=lease_seconds, workflows=workflows,
                     settings=self.settings)

    async def claim_async(self, conn: AsyncConn, *, worker: str, lease_seconds: float,
                          workflows: Sequence[str | Workflow] | None = None,
                          ) -> aio.AsyncClaimedRun[Any] | None:
        """:meth:`claim`, awaited."""
        return await aio.claim(conn, worker=worker, lease_seconds=lease_seconds,
                               workflows=workflows, settings=self.settings)

    def get_run(self, conn: SyncConn, run_id: uuid.UUID) -> Run:
        """The run *run_id* as stored (:class:`~outbox.errors.RunNotFound` if none)."""
        return lifecycle.get_run(conn, run_id, settings=self.settings)

    async def get_run_async(self, conn: AsyncConn, run_id: uuid.UUID) -> Run:
        """:meth:`get_run`, awaited."""
        return await aio.get_run(conn, run_id, settings=self.settings)

    def history(self, conn: SyncConn, run_id: uuid.UUID) -> list[Transition]:
        """Every move of run *run_id*, oldest first, with its reason, evidence and actor."""
        return lifecycle.history(conn, run_id, settings=self.settings)

    async def history_async(self, conn: AsyncConn, run_id: uuid.UUID) -> list[Transition]:
        """:meth:`history`, awaited."""
        return await aio.history(conn, run_id, settings=self.settings)

    def move(self, conn: SyncConn, run_id: uuid.UUID, to: RunState | str, *, actor: str,
             reason: str | None = None, evidence: Any = None,
             not_before: datetime | timedelta | None = None, notify: bool = True) -> Run:
        """An operator's move of a run that no worker holds (:func:`outbox.runs.lifecycle.move`).

        A move to ``queued`` wakes an idle worker at commit; ``notify=False`` does not, for a
        transaction that will be prepared (the same holds for :meth:`wake` and :meth:`confirm`).
        """
        return lifecycle.move(conn, run_id, to, actor=actor, reason=reason, evidence=evidence,
                              not_before=not_before, settings=self.settings, notify=notify)

    async def move_async(self, conn: AsyncConn, run_id: uuid.UUID, to: RunState | str, *,
                         actor: str, reason: str | None = None, evidence: Any = None,
                         not_before: datetime | timedelta | None = None,
                         notify: bool = True) -> Run:
        """:meth:`move`, awaited."""
        return await aio.move(conn, run_id, to, actor=actor, reason=reason, evidence=evidence,
                              not_before=not_before, settings=self.settings, notify=notify)

    def wake(self, conn: SyncConn, run_id: uuid.UUID, *,
             at: datetime | timedelta | None = None, notify: bool = True) -> Run:
        """Make a waiting run claimable now (or at *at*)."""
        return lifecycle.wake(conn, run_id, at=at, settings=self.settings, notify=notify)

    async def wake_async(self, conn: AsyncConn, run_id: uuid.UUID, *,
                         at: datetime | timedelta | None = None, notify: bool = True) -> Run:
        """:meth:`wake`, awaited."""
        return await aio.wake(conn, run_id, at=at, settings=self.settings, notify=notify)

    def cancel(self, conn: SyncConn, run_id: uuid.UUID, *, actor: str,
               reason: str = "cancelled") -> children.Cancelled:
        """Fail *run_id* and every unfinished run it started, below it too; each with
        effects to undo compensates first. A run a worker holds is left (listed in
        ``held``); the run itself must be unfinished and not held, or nothing moves."""
        return run_plan(conn, children.cancel_plan(run_id, actor=actor, reason=reason,
                                                   settings=self.settings), self.settings)

    async def cancel_async(self, conn: AsyncConn, run_id: uuid.UUID, *, actor: str,
                           reason: str = "cancelled") -> children.Cancelled:
        """:meth:`cancel`, awaited."""
        return await run_plan_async(conn, children.cancel_plan(
            run_id, actor=actor, reason=reason, settings=self.settings), self.settings)

    def effects(self, conn: SyncConn, run_id: uuid.UUID) -> list[compensation.Effect]:
        """The effects *run_id* emitted with a compensation, in emit order, and how far
        their undoing went (:mod:`outbox.runs.compensation`)."""
        return run_plan(conn, compensation.effects_plan(run_id), self.settings)

    async def effects_async(self, conn: AsyncConn,
                            run_id: uuid.UUID) -> list[compensation.Effect]:
        """:meth:`effects`, awaited."""
        return await run_plan_async(conn, compensation.effects_plan(run_id), self.settings)

    def keep_effect(self, conn: SyncConn, run_id: uuid.UUID, message_id: uuid.UUID, *,
                    actor: str, reason: str) -> compensation.Effect:
        """A person's decision that an effect of a compensating run in ``needs-human`` stays
        as it is (its outcome cannot be learnt, or its undo cannot be sent); requeue the run
        to go on (:func:`outbox.runs.compensation.keep_plan`)."""
        return run_plan(conn, compensation.keep_plan(run_id, message_id, actor=actor,
                                                     reason=reason), self.settings)

    async def keep_effect_async(self, conn: AsyncConn, run_id: uuid.UUID,
                                message_id: uuid.UUID, *, actor: str,
                                reason: str) -> compensation.Effect:
        """:meth:`keep_effect`, awaited."""
        return await run_plan_async(conn, compensation.keep_plan(
            run_id, message_id, actor=actor, reason=reason), self.settings)

    def confirm(self, conn: SyncConn, *, run_id: uuid.UUID, confirmation_id: str | uuid.UUID,
                outcome: Outcome, evidence: Any, actor: str, reason: str | None = None,
                notify: bool = True) -> bool:
        """Move a *waiting* run on with evidence, once per *confirmation_id* (a consumer's
        ``ctx.confirm`` does this in its handler's transaction); False if already applied."""
        return confirm.apply_confirmation(
            conn, run_id=run_id, confirmation_id=confirmation_id, outcome=outcome,
            evidence=evidence, actor=actor, reason=reason, settings=self.settings, notify=notify)

    async def confirm_async(self, conn: AsyncConn, *, run_id: uuid.UUID,
                            confirmation_id: str | uuid.UUID, outcome: Outcome, evidence: Any,
                            actor: str, reason: str | None = None,
                            notify: bool = True) -> bool:
        """:meth:`confirm`, awaited."""
        return await aio.apply_confirmation(
            conn, run_id=run_id, confirmation_id=confirmation_id, outcome=outcome,
            evidence=evidence, actor=actor, reason=reason, settings=self.settings, notify=notify)

    def confirmations(self, conn: SyncConn, run_id: uuid.UUID, *,
                      ids: Collection[str | uuid.UUID] | None = None) -> dict[str, Confirmation]:
        """The confirmations applied to run *run_id* (only *ids*, if given), by id."""
        return confirm.confirmations(conn, run_id, ids=ids, settings=self.settings)

    async def confirmations_async(self, conn: AsyncConn, run_id: uuid.UUID, *,
                                  ids: Collection[str | uuid.UUID] | None = None,
                                  ) -> dict[str, Confirmation]:
        """:meth:`confirmations`, awaited."""
        return await aio.confirmations(conn, run_id, ids=ids, settings=self.settings)

    def recorded(self, conn: SyncConn, run_id: uuid.UUID,
                 step_key: str) -> steps.StepRecord | None:
        """The result recorded for *step_key* of run *run_id*, if any."""
        return steps.recorded(conn, run_id, step_key, settings=self.settings)

    async def recorded_async(self, conn: AsyncConn, run_id: uuid.UUID,
                             step_key: str) -> steps.StepRecord | None:
        """:meth:`recorded`, awaited."""
        return await aio.recorded(conn, run_id, step_key, settings=self.settings)

    def read_log(self, conn: SyncConn, run_id: uuid.UUID, *,
                 upto: int | None = None) -> list[Any]:
        """The entries of run *run_id*'s log, in order (those before *upto*, if given)."""
        return runlog.read_log(conn, run_id, upto=upto, settings=self.settings)

    async def read_log_async(self, conn: AsyncConn, run_id: uuid.UUID, *,
                             upto: int | None = None) -> list[Any]:
        """:meth:`read_log`, awaited."""
        return await aio.read_log(conn, run_id, upto=upto, settings=self.settings)

    def run_events(self, conn: SyncConn, run_id: uuid.UUID, *, after: int = 0,
                   limit: int = 100) -> list[events.RunEvent]:
        """Run *run_id*'s committed events numbered after *after*, in order, at most *limit*
        (moves, log entries, effects, confirmations, approvals: :mod:`outbox.runs.events`).
        Numbered in commit order: ask again with the last number seen, and nothing is missed
        or seen twice."""
        return events.run_events(conn, run_id, after=after, limit=limit,
                                 settings=self.settings)

    async def run_events_async(self, conn: AsyncConn, run_id: uuid.UUID, *, after: int = 0,
                               limit: int = 100) -> list[events.RunEvent]:
        """:meth:`run_events`, awaited."""
        return await aio.run_events(conn, run_id, after=after, limit=limit,
                                    settings=self.settings)

    def follow_run_events(self, engine: Engine | AsyncEngine, run_id: uuid.UUID, *,
                          after: int = 0, poll: float = events.DEFAULT_POLL,
                          ) -> AsyncGenerator[events.RunEvent, None]:
        """``async for event in app.follow_run_events(engine, run_id, after=n)``: the run's
        events after *after*, then each as it commits (read every *poll* seconds, in
        transactions of its own on *engine*), until the run is finished and all were
        yielded (:func:`outbox.runs.events.follow_run_events`)."""
        return events.follow_run_events(engine, run_id, after=after, poll=poll,
                                        settings=self.settings)

    def retire(self, conn: SyncConn, name: str, *, reason: str) -> None:
        """Retire workflow *name*: no worker claims its runs any more."""
        retire(conn, name, reason=reason, settings=self.settings)

    async def retire_async(self, conn: AsyncConn, name: str, *, reason: str) -> None:
        """:meth:`retire`, awaited."""
        await aio.retire(conn, name, reason=reason, settings=self.settings)

    # -- approvals ----------------------------------------------------------------------------

    def request_approval(self, conn: SyncConn, run_id: uuid.UUID, *, scope: Mapping[str, Any],
                         expires_at: datetime | timedelta, reason: str | None = None,
                         digest: str | None = None) -> approvals.Approval:
        """Ask a person to allow *scope* for run *run_id* until *expires_at*; *digest*
        (``call_digest(tool, args)``, scope ``{"tool": tool, "args": args}``) binds it to that
        one call, which the run then spends once (``job.spend_approval``)."""
        return approvals.request_approval(conn, run_id, scope=scope, expires_at=expires_at,
                                          reason=reason, digest=digest, settings=self.settings)

    async def request_approval_async(self, conn: AsyncConn, run_id: uuid.UUID, *,
                                     scope: Mapping[str, Any],
                                     expires_at: datetime | timedelta,
                                     reason: str | None = None,
                                     digest: str | None = None) -> approvals.Approval:
        """:meth:`request_approval`, awaited."""
        return await aio.request_approval(conn, run_id, scope=scope, expires_at=expires_at,
                                          reason=reason, digest=digest, settings=self.settings)

    def grant(self, conn: SyncConn, approval_id: uuid.UUID, *, by: str,
              reason: str | None = None, digest: str | None = None) -> approvals.Approval:
        """Grant approval *approval_id* (``outbox approvals grant`` does this), saying why;
        *digest*: the call the person was shown, refused if the approval binds another."""
        return approvals.grant(conn, approval_id, by=by, reason=reason, digest=digest,
                               settings=self.settings)

    async def grant_async(self, conn: AsyncConn, approval_id: uuid.UUID, *, by: str,
                          reason: str | None = None,
                          digest: str | None = None) -> approvals.Approval:
        """:meth:`grant`, awaited."""
        return await aio.grant(conn, approval_id, by=by, reason=reason, digest=digest,
                               settings=self.settings)

    def revoke(self, conn: SyncConn, approval_id: uuid.UUID, *, by: str,
               reason: str | None = None) -> approvals.Approval:
        """Revoke approval *approval_id*: a run that revalidates it stops."""
        return approvals.revoke(conn, approval_id, by=by, reason=reason, settings=self.settings)

    async def revoke_async(self, conn: AsyncConn, approval_id: uuid.UUID, *, by: str,
                           reason: str | None = None) -> approvals.Approval:
        """:meth:`revoke`, awaited."""
        return await aio.revoke(conn, approval_id, by=by, reason=reason, settings=self.settings)

    def approvals_audit(self, conn: SyncConn, *, run_id: uuid.UUID | None = None,
                        limit: int = 100) -> list[approvals.ApprovalAudit]:
        """Who approved which exact call and the message it was spent on, newest first
        (``outbox approvals audit``)."""
        return approvals.approvals_audit(conn, run_id=run_id, limit=limit,
                                         settings=self.settings)

    async def approvals_audit_async(self, conn: AsyncConn, *, run_id: uuid.UUID | None = None,
                                    limit: int = 100) -> list[approvals.ApprovalAudit]:
        """:meth:`approvals_audit`, awaited."""
        return await aio.approvals_audit(conn, run_id=run_id, limit=limit,
                                         settings=self.settings)

    # -- artifacts ----------------------------------------------------------------------------

    def store_artifact(self, conn: SyncConn, content: bytes, *,
                       media_type: str = "application/octet-stream") -> artifacts.ArtifactRef:
        """Store *content* once under its sha256; a checkpoint keeps the returned ref."""
        return artifacts.store_artifact(conn, content, media_type=media_type,
                                        settings=self.settings)

    async def store_artifact_async(self, conn: AsyncConn, content: bytes, *,
                                   media_type: str = "application/octet-stream",
                                   ) -> artifacts.ArtifactRef:
        """:meth:`store_artifact`, awaited."""
        return await aio.store_artifact(conn, content, media_type=media_type,
                                        settings=self.settings)

    def load_artifact(self, conn: SyncConn, ref: artifacts.ArtifactRef | str) -> bytes:
        """The bytes of artifact *ref* (:class:`~outbox.errors.ArtifactNotFound` if none)."""
        return artifacts.load_artifact(conn, ref, settings=self.settings)

    async def load_artifact_async(self, conn: AsyncConn,
                                  ref: artifacts.ArtifactRef | str) -> bytes:
        """:meth:`load_artifact`, awaited."""
        return await aio.load_artifact(conn, ref, settings=self.settings)

    # -- messages -----------------------------------------------------------------------------

    def emit(self, conn: SyncConn, envelope: Envelope, *, notify: bool = True) -> uuid.UUID:
        """Add *envelope* to the outbox in the caller's transaction (no run: a handle's
        ``job.emit`` is the fenced spelling); the relay sees it when the caller commits.

        ``notify=False``: wake no idle relay, for a transaction that will be prepared.
        """
        return emitting.emit(conn, envelope, settings=self.settings, notify=notify)

    async def emit_async(self, conn: AsyncConn, envelope: Envelope, *,
                         notify: bool = True) -> uuid.UUID:
        """:meth:`emit`, awaited."""
        return await aio.emit(conn, envelope, settings=self.settings, notify=notify)

    def emit_many(self, conn: SyncConn, envelopes: Sequence[Envelope], *,
                  notify: bool = True) -> list[uuid.UUID]:
        """Several messages in one statement, deadlock-free across keys; ids in order."""
        return emitting.emit_many(conn, envelopes, settings=self.settings, notify=notify)

    async def emit_many_async(self, conn: AsyncConn, envelopes: Sequence[Envelope], *,
                              notify: bool = True) -> list[uuid.UUID]:
        """:meth:`emit_many`, awaited."""
        return await aio.emit_many(conn, envelopes, settings=self.settings, notify=notify)

    # -- maintenance (each runs its own transactions) ----------------------------------------

    def migrate(self, bind: Engine | Connection) -> list[int]:
        """Create or upgrade the outboxkit tables (``outbox migrate``); the versions applied."""
        return migrations.migrate(bind, settings=self.settings)

    def purge(self, engine: Engine, *, older_than: timedelta, batch_size: int = 100,
              max_batches: int = 1000, archive: bool = False,
              states: Collection[RunState | str] = retention.DEFAULT_STATES,
              on_batch: Callable[[int], object] | None = None) -> int:
        """Retention (``outbox purge``): drop the checkpoints, step results, logs and events of runs
        finished longer than *older_than* ago, a batch per transaction; how many runs."""
        return retention.purge(engine, older_than=older_than, batch_size=batch_size,
                               max_batches=max_batches, archive=archive, states=states,
                               settings=self.settings, on_batch=on_batch)
