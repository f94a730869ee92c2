"""A claimed run as one handle: its connection, its settings and its current lease.

:func:`claim` returns a :class:`ClaimedRun`. Each write through it calls the lease function
of the same name (:mod:`outbox.runs.lifecycle`, :mod:`outbox.runs.steps`, :mod:`outbox.runs.retry`,
:mod:`outbox.runs.approvals`, :mod:`outbox.emit`) with the handle's lease and keeps the lease that
write returned, so nobody threads a :class:`~outbox.runs.leases.Lease` by hand. Like those
functions, the handle never commits. The asyncio twin is :class:`outbox.aio.AsyncClaimedRun`.

A handle belongs to one transaction. Workers often claim in one transaction and work in the
next: ``job.on(conn)`` is a handle on another connection that starts from ``job``'s lease.
Keep the handle of the last *committed* transaction: a write that was rolled back advanced
only the lease of the handle that made it, so the handle it was forked from still holds the
lease the database has.

A write after the handle's own lease ended (any transition, which always leaves ``running``;
a release; a handled failure; an approval that did not hold) raises
:class:`~outbox.errors.LeaseSpent` and sends nothing.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, Self, cast

from pydantic import BaseModel
from pydantic_core import to_jsonable_python
from typing_extensions import TypeVar

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.errors import LeaseSpent
from outbox.messages import compensations as compensations_
from outbox.messages.emit import emit as emit_one
from outbox.messages.emit import emit_many as emit_several
from outbox.messages.envelope import Envelope
from outbox.runs import approvals, children, retry, runlog, signals, steps
from outbox.runs import compensation as compensation_
from outbox.runs import lifecycle as runs
from outbox.runs.checkpoints import KEEP
from outbox.runs.leases import Lease
from outbox.runs.states import RunState
from outbox.runs.workflows import Workflow
from outbox.settings import OutboxSettings

C = TypeVar("C")
T = TypeVar("T")
CP = TypeVar("CP", default=Any)
"""The checkpoint's type: ``ClaimedRun[Order]`` (``Any`` when not given)."""


class RunHandle(Generic[C, CP]):
    """What the sync and async handles share: the run, the lease and who ended it."""

    def __init__(self, conn: C, run: runs.Run, lease: Lease, *,
                 settings: OutboxSettings | None = None, ended_by: str | None = None,
                 checkpoint: Any = KEEP) -> None:
        self.conn = conn
        self.run = run
        """The run as claimed: resume from ``run.step`` / ``run.checkpoint``."""
        self.settings = settings
        self._lease = lease
        self._ended_by = ended_by
        self._checkpoint = checkpoint

    @property
    def checkpoint(self) -> CP:
        """The checkpoint as claimed: validated into the step function's type when a worker
        (:class:`outbox.App`) runs it, otherwise ``run.checkpoint`` as stored (JSON)."""
        value = self.run.checkpoint if self._checkpoint is KEEP else self._checkpoint
        return cast(CP, value)

    @property
    def lease(self) -> Lease:
        """The current lease: the one the last write through this handle returned."""
        return self._lease

    @property
    def spent(self) -> bool:
        """True once this handle ended its lease; it then writes nothing more."""
        return self._ended_by is not None

    def __repr__(self) -> str:
        state = f"ended by {self._ended_by}" if self._ended_by else "held"
        return (f"{type(self).__name__}(run={self.run.id}, workflow={self.run.workflow!r}, "
                f"token={self._lease.token}, version={self._lease.version}, {state})")

    def on(self, conn: C) -> Self:
        """This run on *conn* (another transaction), starting from this handle's lease."""
        return type(self)(conn, self.run, self._lease, settings=self.settings,
                          ended_by=self._ended_by, checkpoint=self._checkpoint)

    def _held(self) -> Lease:
        if self._ended_by is not None:
            raise LeaseSpent(self._lease.run_id, self._ended_by)
        return self._lease

    def _kept(self, lease: Lease, *, ends: str | None = None) -> None:
        self._lease = lease
        if ends is not None:
            self._ended_by = ends

    def _compensate_plan(self, reason: str, evidence: Any, actor: str | None,
                         checkpoint: Any) -> Plan[Lease]:
        return compensation_.begin_leased_plan(self._held(), reason=reason, evidence=evidence,
                                               actor=actor, settings=self.settings,
                                               checkpoint=checkpoint)

    def _after_check(self, check: approvals.ApprovalCheck,
                     approval_id: uuid.UUID) -> approvals.ApprovalCheck:
        self._kept(check.lease, ends=None if check.valid else
                   f"revalidate(approval {approval_id}), which moved the run to {check.state}")
        return check


def stored(checkpoint: Any) -> Any:
    """*checkpoint* as JSON data: a pydantic model or a dataclass (a typed checkpoint, e.g.
    ``job.checkpoint`` changed) in pydantic's JSON mode; anything else as given."""
    if isinstance(checkpoint, BaseModel) or (dataclasses.is_dataclass(checkpoint)
                                             and not isinstance(checkpoint, type)):
        return to_jsonable_python(checkpoint)
    return checkpoint


def transition_ends(to: RunState | str) -> str:
    """How :class:`~outbox.errors.LeaseSpent` names a transition (every one ends the lease)."""
    return (f"transition to {RunState(to).value!r} (emit and write before the transition "
            "that ends the lease, in the same transaction)")


class ClaimedRun(RunHandle[SyncConn, CP]):
    """A run this worker holds, bound to a ``Connection`` / ``Session``; never commits."""

    def transition(self, to: RunState | str, *, step: str | None = None,
                   reason: str | None = None, evidence: Any = None, actor: str | None = None,
                   checkpoint: Any = KEEP, wake_at: datetime | timedelta | None = None,
                   log: runlog.Log | None = None) -> None:
        """Move the run (:func:`outbox.runs.lifecycle.transition`); it ends the lease. *log*:
        entries of the run's log written with the move (a durable agent's last ones)."""
        lease = runs.transition(self.conn, self._held(), to, step=step, reason=reason,
                                evidence=evidence, actor=actor, checkpoint=stored(checkpoint),
                                wake_at=wake_at, settings=self.settings, log=log)
        self._kept(lease, ends=transition_ends(to))

    def save_checkpoint(self, checkpoint: Any, *, step: str | None = None,
                        log: runlog.Log | None = None) -> None:
        """:func:`outbox.runs.lifecycle.save_checkpoint`; a pydantic model or a dataclass is
        stored as its JSON form."""
        self._kept(runs.save_checkpoint(self.conn, self._held(), stored(checkpoint), step=step,
                                        log=log, settings=self.settings))

    def renew(self, lease_seconds: float) -> None:
        """:func:`outbox.runs.lifecycle.renew`: extend the lease to ``now() + lease_seconds``."""
        self._kept(runs.renew(self.conn, self._held(), lease_seconds, settings=self.settings))

    def release(self, *, reason: str | None = None) -> None:
        """:func:`outbox.runs.lifecycle.release`: give the run back; it ends the lease."""
        runs.release(self.conn, self._held(), reason=reason, settings=self.settings)
        self._ended_by = "release()"

    def record(self, step_key: str, result: Any, *, checkpoint: Any = KEEP) -> None:
        """:func:`outbox.runs.steps.record`."""
        self._kept(steps.record(self.conn, self._held(), step_key, result,
                                checkpoint=stored(checkpoint), settings=self.settings))

    def run_step(self, step_key: str, fn: Callable[[], T], *, regenerable: bool = False,
                 checkpoint: Any = KEEP) -> steps.StepRun[T]:
        """:func:`outbox.runs.steps.run_step`: the recorded result, or *fn*'s, recorded once."""
        done = steps.run_step(self.conn, self._held(), step_key, fn, regenerable=regenerable,
                              checkpoint=stored(checkpoint), settings=self.settings)
        self._kept(done.lease)
        return done

    def handle_failure(self, error: BaseException, *, policy: retry.RetryPolicy,
                       step: str | None = None, rng: random.Random | None = None,
                       notify: bool = True) -> retry.RetryOutcome:
        """:func:`outbox.runs.retry.handle_failure`; it ends the lease (requeued or given up).
        ``notify=False`` for a transaction that will be prepared (two-phase commit)."""
        outcome = retry.handle_failure(self.conn, self._held(), error, policy=policy, step=step,
                                       rng=rng, settings=self.settings, notify=notify)
        self._kept(outcome.lease, ends=f"handle_failure(), which moved the run to "
                                       f"{outcome.state.value!r}")
        return outcome

    def revalidate(self, approval_id: uuid.UUID, *,
                   scope: Mapping[str, Any]) -> approvals.ApprovalCheck:
        """:func:`outbox.runs.approvals.revalidate`; an approval that fails ends the lease."""
        check = approvals.revalidate(self.conn, self._held(), approval_id, scope=scope,
                                     settings=self.settings)
        return self._after_check(check, approval_id)

    def spend_approval(self, approval_id: uuid.UUID, *, digest: str,
                       message_id: uuid.UUID) -> approvals.Approval:
        """Spend this run's bound approval on the effect's message *message_id*, once
        (:func:`outbox.runs.approvals.spend_plan`): call it beside the :meth:`emit` of that
        message, so both commit together. *digest*: ``call_digest(tool, args)`` of the call
        being sent. Refused with :class:`~outbox.errors.ApprovalInvalid` and the reason (not
        granted, revoked, expired, spent already, other arguments): roll back, send nothing."""
        return run_plan(self.conn, approvals.spend_plan(
            approval_id, digest=digest, message_id=message_id, lease=self._held()),
            self.settings)

    def receive(self, name: str) -> signals.Signal | None:
        """Take the oldest signal *name* sent to this run and not taken yet (``None``: none
        is there), in this transaction: a step that rolls back leaves it for the next
        attempt (:mod:`outbox.runs.signals`)."""
        return run_plan(self.conn, signals.receive_plan(self._held(), name), self.settings)

    def wait_for_signal(self, *names: str, until: datetime | timedelta | None = None,
                        step: str | None = None, reason: str | None = None,
                        actor: str | None = None, checkpoint: Any = KEEP) -> None:
        """Move the run to ``waiting`` until a signal of one of *names* arrives (or *until*:
        then it is claimed with none); claimable at once if one is already there. It ends
        the lease."""
        lease = run_plan(self.conn, signals.wait_plan(
            self._held(), names, until=until, step=step, reason=reason, actor=actor,
            settings=self.settings, checkpoint=stored(checkpoint)), self.settings)
        self._kept(lease, ends=transition_ends(RunState.WAITING))

    def wait_for_children(self, join: children.Join = "all", *,
                          until: datetime | timedelta | None = None, step: str | None = None,
                          reason: str | None = None, actor: str | None = None,
                          checkpoint: Any = KEEP, fail_fast: bool = False,
                          on_failure: children.OnFailure | None = None) -> None:
        """Move the run to ``waiting`` until *join* of its children (``"all"``, ``"first"`` or
        a number) are finished, or *until*, or (*fail_fast*) one of them failed; claimable at
        once if that is so already (:mod:`outbox.runs.children`). *on_failure* (``"fail"``,
        ``"compensate"``): a failed child wakes it too, and the worker then fails it (or undoes
        its effects) and cancels its other children, without running its code. It ends the
        lease."""
        lease = run_plan(self.conn, children.wait_plan(
            self._held(), join, until=until, step=step, reason=reason, actor=actor,
            settings=self.settings, checkpoint=stored(checkpoint), fail_fast=fail_fast,
            on_failure=on_failure),
            self.settings)
        self._kept(lease, ends=transition_ends(RunState.WAITING))

    def children(self) -> list[runs.Run]:
        """The runs this run started (``app.start_run(..., parent=job)``), oldest first."""
        return run_plan(self.conn, children.children_plan(self.run.id), self.settings)

    def emit(self, envelope: Envelope, *, compensation: Envelope | None = None,
             notify: bool = True) -> uuid.UUID:
        """:func:`outbox.messages.emit.emit`, fenced by the lease; the message gets this run's id.
        *compensation*: the effect that undoes this one, emitted only if the run compensates
        (:mod:`outbox.runs.compensation`). ``notify=False`` for a transaction that will be
        prepared (two-phase commit)."""
        if compensation is not None:
            return run_plan(self.conn, compensations_.record_plan(
                self._held(), envelope, compensation, self.settings, notify), self.settings)
        return emit_one(self.conn, envelope, lease=self._held(), settings=self.settings,
                        notify=notify)

    def compensate(self, *, reason: str, evidence: Any = None, actor: str | None = None,
                   checkpoint: Any = KEEP) -> None:
        """Undo this run's confirmed effects, the last first, then end it ``failed``
        (:mod:`outbox.runs.compensation`); it ends the lease."""
        self._kept(run_plan(self.conn, self._compensate_plan(reason, evidence, actor,
                                                             stored(checkpoint)), self.settings),
                   ends="compensate()")

    def effects(self) -> list[compensation_.Effect]:
        """The effects this run emitted with a compensation, in emit order, and their state."""
        return run_plan(self.conn, compensation_.effects_plan(self.run.id), self.settings)

    def emit_many(self, envelopes: Sequence[Envelope], *,
                  compensations: Sequence[Envelope | None] | None = None,
                  notify: bool = True) -> list[uuid.UUID]:
        """:func:`outbox.messages.emit.emit_many`, fenced by the lease; *compensations*: one
        per envelope (``None`` where it has none), as :meth:`emit`'s ``compensation``."""
        specs = compensations_.undos(envelopes, compensations, self.settings)
        ids = emit_several(self.conn, envelopes, lease=self._held(), settings=self.settings,
                           notify=notify)
        run_plan(self.conn, compensations_.recorded_many(self._held(), ids, envelopes, specs),
                 self.settings)
        return ids


def claim(conn: SyncConn, *, worker: str, lease_seconds: float,
          workflows: Sequence[str | Workflow] | None = None,
          settings: OutboxSettings | None = None) -> ClaimedRun | None:
    """Lease one runnable run to *worker* and return its handle, or ``None``; never commits.

    :func:`outbox.runs.lifecycle.claim` says which runs are runnable; it returns the bare run and
    lease, for callers who thread the lease themselves. The handle carries *settings* to
    every write. Commit promptly: the run's row stays locked until then.
    """
    got = runs.claim(conn, worker=worker, lease_seconds=lease_seconds, workflows=workflows,
                     settings=settings)
    return None if got is None else ClaimedRun(conn, got.run, got.lease, settings=settings)
