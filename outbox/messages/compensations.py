"""The messages of compensation: an effect recorded with its undoing, and the worker's turn
of a compensating run, which sends the undoing messages one at a time, last effect first.

What compensation is, and the rules, are in :mod:`outbox.runs.compensation` (the run side:
effects, entering compensation). This side sends messages, so it lives with them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.db.execution import Plan
from outbox.db.tables import agent_runs, confirmations, operations, run_effects
from outbox.errors import ConfigurationError
from outbox.messages.emit import emit_plan
from outbox.messages.envelope import Envelope, encode
from outbox.runs import fencing
from outbox.runs.checkpoints import KEEP
from outbox.runs.compensation import (
    LEARN_LIMIT,
    RECHECK,
    RECHECK_MAX,
    STEP,
    UNDECIDED,
    Effect,
    compensation_id,
    effects_plan,
)
from outbox.runs.leases import Lease
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings, default_settings

_OPEN_OPERATION = ("pending", "unknown", "not-applied", "needs-human")


def declared(envelope: Envelope, compensation: Envelope) -> dict[str, Any]:
    """*compensation* as stored with the effect, or a ConfigurationError naming what is
    wrong (checked before anything is written)."""
    if compensation.payload is not None and not isinstance(compensation.payload, dict):
        raise ConfigurationError(
            f"the compensation of {envelope.type!r} needs a JSON object payload (outbox adds "
            f"the effect's evidence under 'compensates'), "
            f"got {type(compensation.payload).__name__}")
    if isinstance(compensation.payload, dict) and "compensates" in compensation.payload:
        raise ConfigurationError(f"the compensation of {envelope.type!r}: its payload's "
                                 "'compensates' is outbox's (the effect and its evidence)")
    if isinstance(compensation.key, bytes):
        raise ConfigurationError(f"the compensation of {envelope.type!r} needs a text key")
    return compensation.model_dump(mode="json", include={
        "topic", "type", "key", "payload", "headers", "correlation_id", "schema_version"})


def checked(envelope: Envelope, compensation: Envelope,
            settings: OutboxSettings | None) -> dict[str, Any]:
    """*compensation* as stored with *envelope*'s effect, or the error that names what is
    wrong, before anything is written."""
    spec = declared(envelope, compensation)
    # The undo as it will be sent (less the effect's evidence), checked as emit checks it now:
    # a bad topic or header fails this step, not the compensation it exists for.
    encode(compensation.model_copy(update={"payload": {**(compensation.payload or {}),
                                                       "compensates": {}}}),
           settings or default_settings())
    return spec


def effects_insert(lease: Lease, effects: Sequence[tuple[uuid.UUID, str, dict[str, Any]]]) -> Any:
    """The rows of *effects* ((message id, type, stored undo), in emit order). An effect
    emitted again under its own message id (a requeued run's step) is recorded once."""
    return (pg_insert(run_effects).values([
        {"run_id": lease.run_id, "message_id": message_id, "type": kind, "compensation": spec}
        for message_id, kind, spec in effects]).on_conflict_do_nothing(
            index_elements=["message_id"]))


def record_plan(lease: Lease, envelope: Envelope, compensation: Envelope,
                settings: OutboxSettings | None, notify: bool) -> Plan[uuid.UUID]:
    """Emit *envelope* under *lease* and record that *compensation* undoes it."""
    spec = checked(envelope, compensation, settings)
    message_id = yield from emit_plan(envelope, lease=lease, settings=settings, notify=notify)
    yield effects_insert(lease, [(message_id, envelope.type, spec)])
    return message_id


def undos(envelopes: Sequence[Envelope], compensations: Sequence[Envelope | None] | None,
          settings: OutboxSettings | None) -> list[dict[str, Any] | None]:
    """For ``emit_many``: each envelope's stored undo (``None``: it has none), checked."""
    if compensations is None:
        return [None] * len(envelopes)
    if len(compensations) != len(envelopes):
        raise ConfigurationError(f"{len(compensations)} compensations for {len(envelopes)} "
                                 "envelopes: give one per envelope (None where there is none)")
    return [None if undo is None else checked(envelope, undo, settings)
            for envelope, undo in zip(envelopes, compensations, strict=True)]


def recorded_many(lease: Lease, ids: Sequence[uuid.UUID], envelopes: Sequence[Envelope],
                  specs: Sequence[dict[str, Any] | None]) -> Plan[None]:
    """Record the effects of an ``emit_many`` that declared an undo."""
    rows = [(i, e.type, spec) for i, e, spec in zip(ids, envelopes, specs, strict=True)
            if spec is not None]
    if rows:
        yield effects_insert(lease, rows)


def step_plan(lease: Lease, *, actor: str, settings: OutboxSettings | None) -> Plan[Lease]:
    """One turn of a compensating run under *lease*; it always ends the lease (waits for an
    outcome, goes to a person, or finishes the run ``failed``)."""
    e, r = run_effects, agent_runs
    # How long it has waited to learn the outcome in hand: since its last progress (an effect
    # decided, an undo sent), its compensation's start or a person's requeue; database clock.
    progress = func.greatest(r.c.compensating_since, select(func.max(e.c.decided_at)).where(
        e.c.run_id == r.c.id).scalar_subquery())
    rows = yield select((func.now() - progress > LEARN_LIMIT).label("overdue")).where(
        r.c.id == lease.run_id)
    since = _Clock(overdue=bool(rows and rows[0]["overdue"]))
    rows = yield (select(e).where(e.c.run_id == lease.run_id, e.c.state.in_(UNDECIDED))
                  .order_by(e.c.seq.desc()))
    for row in rows:
        effect = Effect.from_row(row)
        if effect.state == "refused":  # a person requeued the run: the effect stays
            yield _decide(effect, "kept")
            since = _Clock(overdue=False)  # progress: the next outcome gets its hour
            continue
        if effect.state == "open":
            outcome = yield from outcome_plan(lease.run_id, effect.message_id)
            if outcome is None:
                return (yield from _unknown(lease, f"{effect.type} ({effect.message_id})",
                                            since, actor, settings))
            confirmed, evidence = outcome
            if not confirmed:
                yield _decide(effect, "not-applied", evidence=evidence)
                since = _Clock(overdue=False)
                continue
            sent = yield from _send(lease, row, evidence, settings)
            yield _decide(effect, "compensating", evidence=evidence, compensation_id=sent)
            return (yield from _wait(lease, f"undoing {effect.type}: sent "
                                     f"{row['compensation']['type']} ({sent})", actor, settings,
                                     evidence=evidence))
        assert effect.compensation_id is not None
        outcome = yield from outcome_plan(lease.run_id, effect.compensation_id)
        if outcome is None:
            return (yield from _unknown(lease, f"the undoing of {effect.type} "
                                        f"({effect.compensation_id})", since, actor, settings))
        confirmed, evidence = outcome
        if not confirmed:
            yield _decide(effect, "refused", compensation_evidence=evidence)
            return (yield from _to_person(lease, effect, evidence, actor))
        yield _decide(effect, "compensated", compensation_evidence=evidence)
        since = _Clock(overdue=False)
    return (yield from _finish(lease, actor))


def outcome_plan(run_id: uuid.UUID, message_id: uuid.UUID) -> Plan[tuple[bool, Any] | None]:
    """Whether the effect of message *message_id* took place (True) or was refused (False),
    with the evidence that says so; ``None`` while nobody knows."""
    o = operations
    ops = yield (select(o.c.id, o.c.system, o.c.operation, o.c.status, o.c.reference,
                        o.c.evidence, o.c.resolved_by, o.c.resolution_reason)
                 .where(o.c.message_id == str(message_id))
                 .order_by(o.c.created_at))
    if ops:
        if any(op["status"] in _OPEN_OPERATION for op in ops):
            return None
        evidence = {"operations": [{**op, "id": str(op["id"])} for op in ops]}
        return any(op["status"] == "confirmed" for op in ops), evidence
    c = confirmations
    said = yield select(c.c.outcome, c.c.actor, c.c.evidence).where(
        c.c.run_id == run_id, c.c.confirmation_id == str(message_id))
    if not said:
        return None
    return said[0]["outcome"] != "failed", {"confirmation": dict(said[0])}


def _decide(effect: Effect, state: str, **values: Any) -> Any:
    return (update(run_effects).where(run_effects.c.seq == effect.seq)
            .values(state=state, decided_at=func.now(), **values))


def _send(lease: Lease, row: Mapping[Any, Any], evidence: Any,
          settings: OutboxSettings | None) -> Plan[uuid.UUID]:
    spec = dict(row["compensation"])
    payload = {**(spec.pop("payload", None) or {}), "compensates": {
        "message_id": str(row["message_id"]), "type": row["type"], "evidence": evidence}}
    envelope = Envelope(**spec, payload=payload, message_id=compensation_id(row["message_id"]),
                        causation_id=str(row["message_id"]))
    return (yield from emit_plan(envelope, lease=lease, settings=settings))


@dataclass(frozen=True)
class _Clock:
    overdue: bool  # waited LEARN_LIMIT since the compensation last made progress


def _unknown(lease: Lease, what: str, since: _Clock, actor: str,
             settings: OutboxSettings | None) -> Plan[Lease]:
    """Wait to learn whether *what* took effect, or give it to a person after LEARN_LIMIT."""
    if not since.overdue:
        return (yield from _wait(lease, f"learning whether {what} took effect", actor,
                                 settings))
    then = ("settle the undo's operation or confirm it" if what.startswith("the undoing of")
            else "settle its operation or confirm it, or keep the effect with `outbox runs "
                 "keep-effect`")
    note = (f"whether {what} took effect is still unknown after {LEARN_LIMIT}: a person "
            f"decides ({then}; then requeue the run)")
    return (yield from _move(lease, RunState.NEEDS_HUMAN, note, evidence=None, actor=actor,
                             values={}))


def _wait(lease: Lease, note: str, actor: str, settings: OutboxSettings | None, *,
          evidence: Any = None) -> Plan[Lease]:
    # Looks again by itself after a tenth of the time it has compensated, 5 s to 5 min.
    elapsed = func.extract("epoch", func.now() - agent_runs.c.compensating_since)
    seconds = func.least(func.greatest(elapsed / 10, RECHECK.total_seconds()),
                         RECHECK_MAX.total_seconds())
    until = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, seconds)
    return (yield from fencing.wait_plan(
        lease, ready=False, until=until, waits={}, note=note, step=STEP, checkpoint=KEEP,
        actor=actor, settings=settings, evidence=evidence))


def _to_person(lease: Lease, effect: Effect, evidence: Any, actor: str) -> Plan[Lease]:
    note = (f"the undoing of {effect.type} ({effect.message_id}) was refused: a person decides "
            "(requeue the run to go on compensating; the effect then stays)")
    return (yield from _move(lease, RunState.NEEDS_HUMAN, note, evidence=evidence, actor=actor,
                             values={}))


def _finish(lease: Lease, actor: str) -> Plan[Lease]:
    effects = yield from effects_plan(lease.run_id)
    evidence = {"effects": [{"type": e.type, "message_id": str(e.message_id), "state": e.state,
                             "compensation_id": e.compensation_id and str(e.compensation_id),
                             "compensation_evidence": e.compensation_evidence}
                            for e in reversed(effects) if e.decided_at is not None]}
    undone = sum(1 for e in effects if e.state == "compensated")
    return (yield from _move(lease, RunState.FAILED, f"compensated: {undone} effect(s) undone",
                             evidence=evidence, actor=actor,
                             values={"finished_at": func.now(), "compensating_since": None}))


def _move(lease: Lease, to: RunState, note: str, *, evidence: Any, actor: str,
          values: Mapping[str, Any]) -> Plan[Lease]:
    sources = {RunState.RUNNING.value}
    stmt: Select[Any] = fencing.statement(
        lease.run_id, lease=lease, sources=sources,
        values={"state": to.value, "reason": note, "last_evidence": evidence,
                **fencing.lease_values(clear=True), **values},
        history=[fencing.HistoryRow(to, reason=note, evidence=evidence, actor=actor)])
    row = yield from fencing.write(stmt, lease.run_id, lease, to.value, sources)
    assert row is not None
    return fencing.next_lease(lease, row)
