"""Compensation: undo the confirmed effects of a run, last first, each exactly once.

* A step emits an effect with the effect that undoes it: ``job.emit(reserve,
  compensation=release)``. The message and a ``run_effects`` row commit together.
* When the run fails (its step gave up, it moved itself to ``failed``, a confirmation failed
  it, an operator failed or cancelled it) or a step calls ``job.compensate()``, and it has
  effects not yet decided, it goes back to the queue with ``compensating_since`` set (history:
  ``failed`` then ``queued``). A worker then runs that turn instead of the workflow.
* The worker's turn (:func:`outbox.messages.compensations.step_plan`: it sends messages,
  so it lives with them) takes the undecided effects newest first. An effect's outcome is
  read from the operations ledger (``operations.message_id``) or, without one, from the run's
  confirmations (``confirmation_id`` = the message id):

  - not known yet (no answer, or an operation still pending, unknown or with a person): the
    run waits; the ledger's status queries settle it, and that settlement wakes the run;
  - refused: nothing to undo (``not-applied``);
  - confirmed: its compensation is emitted, its message id derived from the original's, with
    the original's evidence under ``payload["compensates"]``; the run waits for the
    compensation's own outcome, learnt the same way, before the next effect is looked at.
    A refused compensation sends the run to ``needs-human`` (``refused``); a person who
    requeues the run accepts that the effect stays (``kept``) and compensation goes on.

  When every effect is decided the run is ``failed``, its evidence listing each effect and
  compensation. The state, the emits and the effect rows change in the step's transaction,
  under the lease: a worker killed in between leaves the previous commit, and the next one
  emits a compensation at most once.
* While a run compensates, a confirmation only wakes it (its outcome and evidence are kept);
  the effects are what decide.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import CTE, ColumnElement, Insert, RowMapping, exists, func, select, update

from outbox.db.execution import Plan
from outbox.db.tables import agent_runs, run_effects
from outbox.errors import ConfigurationError, IllegalTransition, RunError, RunNotFound
from outbox.runs import fencing, wakeups
from outbox.runs.checkpoints import KEEP, checkpoint_value
from outbox.runs.leases import Lease
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

STEP = "compensating"
"""The step a compensating run stands at."""
RECHECK = timedelta(seconds=5)
"""How long a compensating run first waits for an outcome before it looks again by itself
(a settlement through the ledger or a confirmation wakes it sooner); the wait then grows
with the time it has compensated (a tenth of it), up to :data:`RECHECK_MAX`."""
RECHECK_MAX = timedelta(minutes=5)
LEARN_LIMIT = timedelta(hours=1)
"""How long a compensating run waits to learn an outcome, since its last progress (an effect
decided, an undo sent, its start, a person's requeue), before it goes to a person: an effect
nobody settles blocks the older ones."""
UNDECIDED = ("open", "compensating", "refused")
_NAMESPACE = uuid.UUID("6f1d2a7e-9a52-4c0e-8f4d-0c8d5b1e7a31")


@dataclass(frozen=True)
class Effect:
    """An effect a run emitted with its compensation, and where its undoing stands:
    ``open`` (not decided), ``compensating`` (compensation sent), ``compensated``,
    ``not-applied`` (the effect was refused: nothing to undo), ``refused`` (the compensation
    was refused; a person decides), ``kept`` (a person let the effect stay)."""

    seq: int
    message_id: uuid.UUID
    type: str
    state: str
    evidence: Any
    compensation_id: uuid.UUID | None
    compensation_evidence: Any
    created_at: datetime
    decided_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Effect:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


def compensation_id(message_id: uuid.UUID) -> uuid.UUID:
    """The message id of the compensation of *message_id*: the same on every attempt."""
    return uuid.uuid5(_NAMESPACE, str(message_id))


def effects_plan(run_id: uuid.UUID) -> Plan[list[Effect]]:
    rows = yield select(run_effects).where(run_effects.c.run_id == run_id).order_by(
        run_effects.c.seq)
    return [Effect.from_row(row) for row in rows]


def undecided() -> ColumnElement[bool]:
    """True for a run (in a statement on ``agent_runs``) with effects not decided yet."""
    return exists(select(run_effects.c.seq).where(
        run_effects.c.run_id == agent_runs.c.id, run_effects.c.state.in_(UNDECIDED)))


def failing_plan(run_id: uuid.UUID) -> Plan[str | None]:
    """What a move of *run_id* to ``failed`` must do instead: ``"compensate"`` (effects to
    undo), ``"compensating"`` (it undoes them already: refuse), ``None`` (nothing: fail it)."""
    rows = yield select(undecided().label("undecided"), agent_runs.c.compensating_since).where(
        agent_runs.c.id == run_id)
    if not rows:
        return None
    if rows[0]["compensating_since"] is not None:
        return "compensating"
    return "compensate" if rows[0]["undecided"] else None


def plainly_failed() -> list[ColumnElement[bool]]:
    """The conditions of a plain move to ``failed`` (in its fenced statement, so an effect
    added since :func:`failing_plan` looked makes it miss rather than drop the effect)."""
    return [agent_runs.c.compensating_since.is_(None), ~undecided()]


def refuse_failing(run_id: uuid.UUID, state: str) -> IllegalTransition:
    return IllegalTransition(run_id, state, RunState.FAILED.value,
                             "it is undoing its effects (compensating): let it finish; it "
                             "ends failed by itself")


def begin_plan(run_id: uuid.UUID, *, lease: Lease | None, sources: set[str], reason: str,
               evidence: Any, actor: str | None, step: str | None = None,
               settings: OutboxSettings | None = None, notify: bool = True,
               checkpoint: Any = KEEP, where: tuple[ColumnElement[bool], ...] = (),
               also: Callable[[CTE], Insert] | None = None) -> Plan[RowMapping | None]:
    """Fail the run into compensation: ``failed`` then ``queued`` (history), compensating from
    now, claimable at once; ends any lease. Returns the run's row (``None``: only a condition
    of *where* missed; any other miss raises what explains it)."""
    note = f"compensating: {reason}"
    history = [
        fencing.HistoryRow(RunState.FAILED, reason=note, evidence=evidence, step=step,
                           actor=actor, old_step=True),
        fencing.HistoryRow(RunState.QUEUED, from_state=RunState.FAILED, step=STEP,
                           reason="undoes its confirmed effects, the last first",
                           actor="compensation"),
    ]
    values = {"state": RunState.QUEUED.value, "step": STEP, "attempts": 0, "not_before": None,
              "reason": note, "finished_at": None, "compensating_since": func.now(),
              **fencing.lease_values(clear=True),
              **({} if evidence is None else {"last_evidence": evidence}),
              **({} if checkpoint is KEEP else
                 {"checkpoint": checkpoint_value(checkpoint, settings)})}
    stmt = fencing.statement(run_id, lease=lease, sources=sources, values=values,
                             history=history, where=list(where), also=also,
                             woken=wakeups.woken(settings) if notify else None)
    return (yield from fencing.write(stmt, run_id, lease, RunState.QUEUED.value, sources))


def begin_leased_plan(lease: Lease, *, reason: str, evidence: Any, actor: str | None,
                      step: str | None = None, settings: OutboxSettings | None = None,
                      notify: bool = True, checkpoint: Any = KEEP) -> Plan[Lease]:
    """:func:`begin_plan` for the worker holding *lease* (a step that undoes, or fails)."""
    row = yield from begin_plan(lease.run_id, lease=lease, sources={RunState.RUNNING.value},
                                reason=reason, evidence=evidence, actor=actor or lease.owner,
                                step=step, settings=settings, notify=notify,
                                checkpoint=checkpoint)
    assert row is not None  # without *where*, fencing.write raises on any miss
    return fencing.next_lease(lease, row)


def keep_plan(run_id: uuid.UUID, message_id: uuid.UUID, *, actor: str,
              reason: str) -> Plan[Effect]:
    """A person's decision that an effect stays as it is (``kept``): its outcome cannot be
    learnt, or its undo cannot be sent. Only while the compensating run waits for a person
    (``needs-human``); a requeue then goes on with the effect before it."""
    if not actor or not reason:
        raise ConfigurationError("say who keeps the effect and why (actor, reason)")
    rows = yield (select(agent_runs.c.state, agent_runs.c.compensating_since)
                  .where(agent_runs.c.id == run_id).with_for_update())
    if not rows:
        raise RunNotFound(run_id)
    if rows[0]["compensating_since"] is None or rows[0]["state"] != RunState.NEEDS_HUMAN:
        raise RunError(
            f"run {run_id} is {rows[0]['state']!r}"
            f"{'' if rows[0]['compensating_since'] else ', not compensating'}: an effect is "
            "kept only while a person holds a compensating run (needs-human); nothing was "
            "written")
    e = run_effects
    # Not one whose undo was sent (compensating): that undo may take effect yet; settle
    # the undo's own operation instead.
    kept = yield (update(e).where(e.c.run_id == run_id, e.c.message_id == message_id,
                                  e.c.state.in_(("open", "refused")))
                  .values(state="kept", decided_at=func.now(),
                          compensation_evidence={"kept_by": actor, "reason": reason})
                  .returning(*e.c))
    if not kept:
        raise RunError(f"run {run_id} has no effect {message_id} that is open or whose undo "
                       "was refused (an undo already sent is settled through its own operation)"
                       "; nothing was written")
    return Effect.from_row(kept[0])
