"""Confirmations: a consumer moves a *waiting* run on, with evidence, in its own transaction.

The consumer that performed (or observed) an effect a run waits for is not the run's worker
and holds no lease; it calls :func:`apply_confirmation` inside the transaction in which it
handles the message. The move is fenced by the run's state instead (it must be ``waiting``)
and is idempotent by ``confirmation_id``: a redelivered confirmation changes nothing.

Outcomes and the moves they make (see :data:`outbox.runs.states.ALLOWED`):

* ``running`` — waiting → running, without a lease: the next :func:`outbox.runs.lifecycle.claim`
  picks the run up at once;
* ``done`` — waiting → running → done (done is reachable only from running), two history
  rows, one statement; needs evidence;
* ``failed`` — waiting → failed.

``done`` and ``failed`` also set the run's ``step`` to the outcome: the step the worker
recorded before waiting (``order-submitted``) is no longer where the run stands. ``running``
keeps it: the resumed worker carries on from its step and checkpoint.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import CTE, Insert, exists, func, insert, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import agent_runs
from outbox.db.tables import confirmations as applied
from outbox.errors import ConfigurationError, EvidenceRequired, IllegalTransition
from outbox.runs import compensation, fencing, wakeups
from outbox.runs.states import FINISHED, RunState
from outbox.settings import OutboxSettings

Outcome = Literal["running", "done", "failed"]


@dataclass(frozen=True)
class Confirmation:
    """A confirmation as applied: who moved the run, to what, with which evidence (``None``
    for confirmations applied before migration 0008 kept it)."""

    run_id: uuid.UUID
    confirmation_id: str
    outcome: str
    actor: str
    evidence: Any
    applied_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Confirmation:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})

OUTCOMES: frozenset[str] = frozenset({"running", "done", "failed"})
_WAITING = frozenset({RunState.WAITING.value})
_FINISHED = frozenset(s.value for s in FINISHED)


def apply_confirmation(
    conn: SyncConn,
    *,
    run_id: uuid.UUID,
    confirmation_id: str | uuid.UUID,
    outcome: Outcome,
    evidence: Any,
    actor: str,
    reason: str | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> bool:
    """Move the waiting run *run_id* to *outcome*; True if applied, False if already applied.

    Never commits: the move takes effect with the caller's transaction (typically together
    with the consumer's own dedup record). *confirmation_id* identifies the confirmation
    (e.g. the message id the consumer handled); applying it again returns False and writes
    nothing. ``outcome="running"`` wakes an idle worker at commit; ``notify=False`` for a
    transaction that will be prepared (no NOTIFY).

    Raises:
        EvidenceRequired: ``done`` without evidence (checked before anything is sent).
        RunNotFound: no such run.
        IllegalTransition: the run is not waiting (and this confirmation was not applied).
    """
    plan = confirmation_plan(
        run_id, str(confirmation_id), outcome=outcome, evidence=evidence, actor=actor,
        reason=reason, settings=settings, notify=notify,
    )
    return run_plan(conn, plan, settings)


def confirmations(conn: SyncConn, run_id: uuid.UUID, *,
                  ids: Collection[str | uuid.UUID] | None = None,
                  settings: OutboxSettings | None = None) -> dict[str, Confirmation]:
    """The confirmations applied to *run_id* (only those in *ids*, when given), by id.

    A worker that resumes a run reads here what the confirmation of *its* request said: the
    run's ``last_evidence`` is only the latest write's.
    """
    return run_plan(conn, confirmations_plan(run_id, ids), settings)


def confirmations_plan(run_id: uuid.UUID,
                       ids: Collection[str | uuid.UUID] | None) -> Plan[dict[str, Confirmation]]:
    query = select(applied).where(applied.c.run_id == run_id)
    if ids is not None:
        query = query.where(applied.c.confirmation_id.in_([str(i) for i in ids]))
    rows = yield query
    return {row["confirmation_id"]: Confirmation.from_row(row) for row in rows}


def confirmation_plan(
    run_id: uuid.UUID,
    confirmation_id: str,
    *,
    outcome: str,
    evidence: Any,
    actor: str,
    reason: str | None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> Plan[bool]:
    """The plan of :func:`apply_confirmation`, for callers composing it with their own writes
    (the operations ledger settles a run together with its operation)."""
    if outcome not in OUTCOMES:
        raise ConfigurationError(f"outcome must be one of {sorted(OUTCOMES)}, got {outcome!r}")
    if not actor:
        raise ConfigurationError("actor must name who confirms (e.g. the consumer group)")
    if outcome == RunState.DONE and evidence in (None, "", {}, []):
        raise EvidenceRequired(run_id, outcome)
    note = reason or f"confirmed {outcome} by {actor} ({confirmation_id})"
    history = [fencing.HistoryRow(RunState.RUNNING, reason=note, evidence=evidence, actor=actor)]
    values: dict[str, Any] = {"state": outcome, "reason": note, "not_before": None}
    if evidence is not None:
        values["last_evidence"] = evidence
    if outcome != RunState.RUNNING:
        values["finished_at"] = func.now()
        values["step"] = outcome
    if outcome == RunState.DONE:
        # done is reached from running only: record both moves, as the state table demands.
        history.append(
            fencing.HistoryRow(
                RunState.DONE,
                from_state=RunState.RUNNING,
                reason=note,
                evidence=evidence,
                actor=actor,
            )
        )
    elif outcome == RunState.FAILED:
        history = [fencing.HistoryRow(RunState.FAILED, reason=note, evidence=evidence, actor=actor)]

    def record(moved: CTE) -> Insert:
        return insert(applied).from_select(
            ["run_id", "confirmation_id", "outcome", "actor", "evidence"],
            select(moved.c.id, literal(confirmation_id), literal(outcome), literal(actor),
                   literal(evidence, applied.c.evidence.type)),
        )

    already = exists(
        select(applied.c.run_id).where(
            applied.c.run_id == agent_runs.c.id,
            applied.c.confirmation_id == confirmation_id,
        )
    )
    # The common case in one statement; a compensating run, or one that fails with effects
    # to undo, misses it and is handled below (nothing else can add effects meanwhile: the
    # run waits, nobody holds its lease).
    plain = [~already, agent_runs.c.compensating_since.is_(None)]
    if outcome == RunState.FAILED:
        plain.append(~compensation.undecided())
    stmt = fencing.statement(
        run_id,
        lease=None,
        sources=_WAITING,
        values=values,
        history=history,
        where=plain,
        also=record,
        # moved on (running, no lease): claimable at once, so wake an idle worker
        woken=wakeups.woken(settings) if notify and outcome == RunState.RUNNING else None,
    )
    rows = yield stmt
    if rows:
        return True
    # A fresh statement (fresh snapshot): sees a duplicate that committed while we waited
    # for the run's row lock, after which the run was no longer waiting.
    duplicate = yield select(applied.c.outcome).where(
        applied.c.run_id == run_id, applied.c.confirmation_id == confirmation_id
    )
    if duplicate:
        return False
    if (moved := (yield from _compensating_plan(
            run_id, confirmation_id, outcome, note=note, evidence=evidence, actor=actor,
            where=[~already],
            record=record, settings=settings, notify=notify))):
        return moved
    yield from fencing.explain(run_id, None, outcome, _WAITING)
    raise IllegalTransition(run_id, RunState.WAITING.value, outcome)  # not reached in practice


def _compensating_plan(run_id: uuid.UUID, confirmation_id: str, outcome: str, *, note: str,
                       evidence: Any,
                       actor: str, where: list[Any], record: Callable[[CTE], Insert],
                       settings: OutboxSettings | None, notify: bool) -> Plan[bool]:
    """A confirmation of a run that compensates (kept for the effects to read, which decide;
    it only wakes the run if it waits), or one that fails a run with effects to undo (it
    compensates first). False: neither applies."""
    rows = yield (select(agent_runs.c.state, agent_runs.c.compensating_since,
                         compensation.undecided().label("undecided"))
                  .where(agent_runs.c.id == run_id).with_for_update())
    if not rows or rows[0]["state"] in _FINISHED:
        return False
    if rows[0]["compensating_since"] is not None:
        if rows[0]["state"] != RunState.WAITING:  # queued, running: its next turn reads it
            kept = yield (pg_insert(applied).values(
                run_id=run_id, confirmation_id=confirmation_id, outcome=outcome, actor=actor,
                evidence=evidence).on_conflict_do_nothing().returning(applied.c.run_id))
            return bool(kept)
        stmt = fencing.statement(
            run_id, lease=None, sources=_WAITING, where=where, also=record,
            values={"state": RunState.RUNNING.value, "not_before": None, "reason": note},
            history=[fencing.HistoryRow(RunState.RUNNING, reason=note, evidence=evidence,
                                        actor=actor)],
            woken=wakeups.woken(settings) if notify else None)
        return bool((yield stmt))
    if rows[0]["state"] != RunState.WAITING or outcome != RunState.FAILED \
            or not rows[0]["undecided"]:
        return False
    moved = yield from compensation.begin_plan(
        run_id, lease=None, sources=set(_WAITING), reason=note, evidence=evidence, actor=actor,
        settings=settings, notify=notify, where=tuple(where), also=record)
    return moved is not None
