"""The ledger of operations on outside systems: intent before the call, outcome after it.

An outside write (placing an order, charging a card) cannot join our transaction. So the
ledger splits it in three steps, each of which survives a crash of the next:

1. :func:`begin` records the *intent* — idempotency key, request digest, status ``pending``
   — and the caller **commits it before calling**. From then on a crash cannot lose the fact
   that we may have sent the request.
2. The caller calls the outside system, passing the idempotency key.
3. :func:`record_outcome` records ``confirmed`` / ``rejected`` with the system's evidence,
   or :func:`mark_unknown` records that we did not see the outcome (timeout, dropped
   connection). Unknown is never failed: the supplier may have taken the order.

An operation left ``pending`` (the process died during the call) or ``unknown`` is
reconciled by asking the outside system (:mod:`dedup.ledger.reconcile`), never by calling again
blindly. :func:`dedup.ledger.perform.perform` does all three steps with its own transactions.

An operation may carry the ``run_id`` of the agent run that waits on it. Whatever settles
the operation — :func:`record_outcome` (the call's own answer, or a reconciler's status
query) or a person (:mod:`dedup.ledger.resolution`) — settles that run in the same transaction
(:func:`settle_run_plan`), as a confirmation whose id is the operation's ``message_id``: the
run is finished (confirmed → ``done``, rejected → ``failed``) or resumed
(:class:`OnSettle`), with the outside system's evidence. A run that cannot move (no longer
waiting) never undoes the operation's outcome: the event says why.

Every function here takes the caller's ``Connection``/``Session`` and **never commits**.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Insert, Select, Update, cast, func, insert, literal, null, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from dedup.ledger.errors import OperationNotFound, RequestMismatch
from dedup.ledger.outcomes import Applied, Evidence, Found, Refused, canonical_digest
from outbox.db.execution import Plan, Rows, SyncConn, run_plan
from outbox.db.tables import agent_runs, operation_events, operations, run_transitions
from outbox.errors import ConfigurationError, OutboxError
from outbox.runs.checkpoints import json_value
from outbox.runs.confirm import confirmation_plan
from outbox.runs.lifecycle import move_plan
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)
ops, events = operations, operation_events


class OperationStatus(StrEnum):
    """Where an operation stands. Only ``confirmed`` and ``rejected`` are settled."""

    PENDING = "pending"
    """Intent committed; the call is in flight, or its process died: we may have sent it."""
    UNKNOWN = "unknown"
    """Sent, outcome not seen (timeout, dropped connection): reconcile, never repeat blindly."""
    NOT_APPLIED = "not-applied"
    """A human established it was not applied: the reconciler calls again with the same key."""
    CONFIRMED = "confirmed"
    REJECTED = "rejected"
    NEEDS_HUMAN = "needs-human"
    """The outcome could not be established within the policy's bounds."""


class OnSettle(StrEnum):
    """What settling a run-linked operation does to the run that waits on it."""

    FINISH = "finish"
    """Confirmed → the run is ``done``, rejected → ``failed``, with the outside system's
    evidence. The default: resuming a worker that does not check its checkpoint could make
    the call a second time."""
    RESUME = "resume"
    """The run goes back to ``running`` (its worker's next claim carries on, the evidence in
    ``last_evidence``), confirmed or rejected alike: for agents with steps after the call."""


OPEN = frozenset({OperationStatus.PENDING, OperationStatus.UNKNOWN, OperationStatus.NOT_APPLIED})
"""Statuses a reconciler works on."""
SETTLED = frozenset({OperationStatus.CONFIRMED, OperationStatus.REJECTED})


@dataclass(frozen=True)
class Operation:
    """One ledger row. ``request`` is what to send again (with the same key) if needed."""

    id: uuid.UUID
    idempotency_key: str
    system: str
    operation: str
    message_id: str | None
    run_id: uuid.UUID | None
    request_digest: str
    request: Any
    status: OperationStatus
    calls: int
    checks: int
    version: int
    reference: str | None
    response_digest: str | None
    evidence: Any
    last_error: str | None
    next_check_at: datetime | None
    resolved_by: str | None
    resolution_reason: str | None
    created_at: datetime
    updated_at: datetime
    resolved_at: datetime | None
    on_settle: OnSettle = OnSettle.FINISH

    @property
    def settled(self) -> bool:
        """True when the outside system's answer is established (confirmed or rejected)."""
        return self.status in SETTLED

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Operation:
        values = {name: row[name] for name in cls.__dataclass_fields__}
        values["status"] = OperationStatus(row["status"])
        values["on_settle"] = OnSettle(row["on_settle"])
        return cls(**values)


@dataclass(frozen=True)
class OperationEvent:
    """One ``operation_events`` row: a call, a check, a retry, an escalation, a resolution."""

    id: int
    operation_id: uuid.UUID
    kind: str
    outcome: str
    detail: Any
    actor: str | None
    at: datetime

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "outcome": self.outcome, "detail": self.detail,
                "actor": self.actor, "at": self.at.isoformat()}


@dataclass(frozen=True)
class Intent:
    """What :func:`begin` found: ``created`` is True when this call recorded the intent
    (so the caller must now make the call); False when the key was already recorded."""

    operation: Operation
    created: bool


def idempotency_key(message_id: uuid.UUID | str, operation: str) -> str:
    """The idempotency key for *operation* done on behalf of message *message_id*.

    Stable across redeliveries of the message and retries of the call; different for two
    operations the same message causes (``place-order`` and ``notify-customer``).
    """
    if not str(message_id) or not operation:
        raise ConfigurationError("idempotency_key needs a message id and an operation name")
    return f"{operation}:{message_id}"


def event_insert(
    operation_id: Any, kind: str, outcome: str, detail: Any, actor: str | None
) -> Insert:
    """An ``operation_events`` row (*operation_id* may be a column of a CTE via from_select)."""
    return insert(events).values(
        operation_id=operation_id, kind=kind, outcome=outcome,
        detail=cast(null(), JSONB) if detail is None else json_value(detail), actor=actor,
    )


def _with_event(write: Insert | Update, kind: str, outcome: str, detail: Any,
                actor: str | None) -> Select[Any]:
    """*write* (an insert or update of one operation) and its event as one statement that
    returns the operation's row: the event is written only when *write* touched a row."""
    changed = write.returning(*ops.c).cte("changed")
    event = insert(events).from_select(
        ["operation_id", "kind", "outcome", "detail", "actor"],
        select(changed.c.id, literal(kind), literal(outcome),
               cast(null(), JSONB) if detail is None else json_value(detail), literal(actor)),
    )
    return select(changed).add_cte(event.cte("hist"))


def _single(stmt: Any) -> Plan[Rows]:
    rows = yield stmt
    return rows


def fetch(conn: SyncConn, stmt: Select[Any] | Any,
          settings: OutboxSettings | None = None) -> Rows:
    """Run one Core statement on the configured schema (a helper for this package)."""
    return run_plan(conn, _single(stmt), settings)


# --- plans ----------------------------------------------------------------------------------


def on_settle_value(on_settle: OnSettle | str) -> OnSettle:
    """*on_settle* as an :class:`OnSettle`, or a ConfigurationError naming the choices."""
    try:
        return OnSettle(on_settle)
    except ValueError:
        raise ConfigurationError(
            f"on_settle must be one of {[o.value for o in OnSettle]}, got {on_settle!r}"
        ) from None


def begin_plan(
    *, key: str, system: str, operation: str, request: Any, run_id: uuid.UUID | None,
    message_id: str | None, in_flight_grace: float, store_request: bool, actor: str,
    on_settle: OnSettle | str = OnSettle.FINISH,
) -> Plan[Intent]:
    if not key or not system or not operation:
        raise ConfigurationError("an operation needs a non-empty key, system and operation name")
    settle = on_settle_value(on_settle)
    digest = canonical_digest(request)
    inserted = (
        pg_insert(ops)
        .values(
            id=uuid.uuid4(), idempotency_key=key, system=system, operation=operation,
            message_id=message_id, run_id=run_id, request_digest=digest,
            request=json_value(request) if store_request else cast(null(), JSONB),
            status=OperationStatus.PENDING.value, calls=1, on_settle=settle.value,
            next_check_at=func.now() + timedelta(seconds=in_flight_grace),
        )
        .on_conflict_do_nothing(index_elements=[ops.c.idempotency_key])
    )
    rows = yield _with_event(inserted, "intent", OperationStatus.PENDING.value,
                             {"request_digest": digest}, actor)
    if rows:
        return Intent(Operation.from_row(rows[0]), created=True)
    # A fresh statement (fresh snapshot) sees a concurrent begin's row once it committed.
    rows = yield select(ops).where(ops.c.idempotency_key == key)
    if not rows:
        raise OperationNotFound(key)  # deleted between the two statements: not in practice
    existing = Operation.from_row(rows[0])
    if existing.request_digest != digest:
        raise RequestMismatch(key, existing.request_digest, digest)
    if (existing.system, existing.operation) != (system, operation):
        raise RequestMismatch(key, f"{existing.system}/{existing.operation}",
                              f"{system}/{operation}", what="system/operation")
    return Intent(existing, created=False)


def record_outcome_plan(
    operation_id: uuid.UUID, outcome: Applied | Refused | Found, *, actor: str,
    kind: str = "call",
) -> Plan[Operation]:
    status = (OperationStatus.REJECTED if isinstance(outcome, Refused)
              else OperationStatus.CONFIRMED)
    evidence: Evidence = outcome.evidence
    detail = {"answer": type(outcome).__name__, **evidence.as_json()}
    now = func.now()
    rows = yield (
        update(ops)
        .where(ops.c.id == operation_id, ops.c.status.in_([s.value for s in OPEN]))
        .values(
            status=status.value, reference=evidence.reference,
            response_digest=evidence.response_digest, evidence=json_value(evidence.as_json()),
            last_error=None, next_check_at=None, version=ops.c.version + 1,
            checks=ops.c.checks + (1 if kind == "check" else 0), updated_at=now,
            resolved_at=now,
        )
        .returning(*ops.c)
    )
    if not rows:
        # Already settled or with a human: keep the answer as evidence, change nothing else.
        current = yield from get_operation_plan(operation_id)
        yield event_insert(operation_id, "late-outcome", status.value, detail, actor)
        return current
    settled = Operation.from_row(rows[0])
    run_note = yield from settle_run_plan(settled, actor=actor)
    yield event_insert(operation_id, kind, status.value, with_run_note(detail, run_note), actor)
    return settled


# --- the run that waits on an operation -----------------------------------------------------


def with_run_note(detail: dict[str, Any], note: str | None) -> dict[str, Any]:
    """An event's *detail* with what happened to the operation's run (if it has one)."""
    return detail if note is None else {**detail, "run": note}


def run_evidence(operation: Operation) -> dict[str, Any]:
    """The evidence a settled operation gives its run: the outside system's answer and how
    it was established (calls, status queries, who resolved it)."""
    evidence: dict[str, Any] = {
        "operation_id": str(operation.id), "system": operation.system,
        "operation": operation.operation, "idempotency_key": operation.idempotency_key,
        "status": operation.status.value, "reference": operation.reference,
        "calls": operation.calls, "checks": operation.checks, "answer": operation.evidence,
    }
    if operation.resolved_by is not None:
        evidence.update(resolved_by=operation.resolved_by,
                        resolution_reason=operation.resolution_reason)
    return evidence


def confirmation_id(operation: Operation) -> str:
    """The id under which the operation confirms its run: the message id when it has one,
    so a handler that also calls ``ctx.confirm`` (same id) finds it already applied."""
    return operation.message_id or f"operation:{operation.id}"


def settle_run_plan(operation: Operation, *, actor: str) -> Plan[str | None]:
    """Settle the run that waits on *operation* (just settled or resolved), in the caller's
    transaction; return what happened to it, for the operation's event (None: no run).

    A run this operation escalated to ``needs-human`` first goes back to ``waiting`` (a
    person, or a late answer, settled what it was escalated for). Then, for a settled
    operation, the run is confirmed (:func:`outbox.runs.confirm.confirmation_plan`): finished or
    resumed as ``on_settle`` says. A run that cannot move is left as it is; the note says
    why and the operation's outcome stands.
    """
    if operation.run_id is None:
        return None
    # Short: the run's reason is shown in tables; the key and the rest are in the evidence.
    what = f"{operation.operation} on {operation.system}"
    reopened = yield from _reopen_plan(operation, actor=actor, what=what)
    back = f"run {operation.run_id} back from needs-human to waiting"
    if operation.status not in SETTLED:
        # not-applied: the reconciler calls again; the run waits for that call's outcome.
        return back if reopened else None
    if operation.on_settle is OnSettle.RESUME:
        outcome = RunState.RUNNING.value
    else:
        outcome = (RunState.DONE if operation.status is OperationStatus.CONFIRMED
                   else RunState.FAILED).value
    said = f": {operation.reference}" if operation.reference else ""
    try:
        applied = yield from confirmation_plan(
            operation.run_id, confirmation_id(operation), outcome=outcome,
            evidence=run_evidence(operation), actor=actor,
            reason=f"{what} {operation.status.value}{said}",
        )
    except OutboxError as exc:
        log.info("operation %s settled; its run %s was not moved: %s", operation.id,
                 operation.run_id, exc, extra={"event": "dedup.run_not_settled"})
        return f"run {operation.run_id} not settled: {exc}"
    if not applied:
        return f"run {operation.run_id} already confirmed by {confirmation_id(operation)}"
    return f"{back}, then {outcome}" if reopened else f"run {operation.run_id} {outcome}"


def _reopen_plan(operation: Operation, *, actor: str, what: str) -> Plan[bool]:
    """Move the run back to ``waiting`` if it is ``needs-human`` because *operation* was
    escalated (its latest transition is that escalation); True if it moved."""
    assert operation.run_id is not None
    run = yield (select(agent_runs.c.state).where(agent_runs.c.id == operation.run_id)
                 .with_for_update())
    if not run or run[0]["state"] != RunState.NEEDS_HUMAN.value:
        return False
    t = run_transitions
    latest = yield (
        select(t.c.to_state, t.c.evidence["operation"]["operation_id"].astext.label("op"))
        .where(t.c.run_id == operation.run_id).order_by(t.c.id.desc()).limit(1)
    )
    if not latest or (latest[0]["to_state"], latest[0]["op"]) != (
            RunState.NEEDS_HUMAN.value, str(operation.id)):
        return False  # needs-human for another reason: a person decides about it
    by = f" by {operation.resolved_by}" if operation.resolved_by else ""
    because = f" ({operation.resolution_reason})" if operation.resolution_reason else ""
    try:
        yield from move_plan(
            operation.run_id, RunState.WAITING, actor=actor, not_before=None,
            reason=f"{what} resolved {operation.status.value}{by}{because}; "
                   "the run waits for its outcome",
            evidence={"operation": {"operation_id": str(operation.id),
                                    "status": operation.status.value,
                                    "resolved_by": operation.resolved_by,
                                    "resolution_reason": operation.resolution_reason}},
        )
    except OutboxError:
        return False  # not in practice (the row is locked): the confirmation will say why
    return True


def mark_unknown_plan(
    operation_id: uuid.UUID, *, reason: str, actor: str, check_in: float
) -> Plan[Operation]:
    changed = (
        update(ops)
        .where(ops.c.id == operation_id, ops.c.status.in_([s.value for s in OPEN]))
        .values(
            status=OperationStatus.UNKNOWN.value, last_error=reason,
            next_check_at=func.now() + timedelta(seconds=check_in),
            version=ops.c.version + 1, updated_at=func.now(),
        )
    )
    rows = yield _with_event(changed, "call", OperationStatus.UNKNOWN.value,
                             {"reason": reason}, actor)
    if rows:
        return Operation.from_row(rows[0])
    return (yield from get_operation_plan(operation_id))


def get_operation_plan(operation_id: uuid.UUID | None = None,
                       key: str | None = None) -> Plan[Operation]:
    if (operation_id is None) == (key is None):
        raise ConfigurationError("give exactly one of operation_id and key")
    where = ops.c.id == operation_id if operation_id is not None else ops.c.idempotency_key == key
    rows = yield select(ops).where(where)
    if not rows:
        raise OperationNotFound(operation_id or key or "?")
    return Operation.from_row(rows[0])


def events_plan(operation_id: uuid.UUID) -> Plan[list[OperationEvent]]:
    rows = yield select(events).where(events.c.operation_id == operation_id).order_by(events.c.id)
    return [OperationEvent(**dict(row)) for row in rows]


# --- the sync API ---------------------------------------------------------------------------


def begin(
    conn: SyncConn,
    *,
    key: str,
    system: str,
    operation: str,
    request: Any,
    run_id: uuid.UUID | None = None,
    message_id: uuid.UUID | str | None = None,
    in_flight_grace: float = 60.0,
    store_request: bool = True,
    actor: str = "ledger",
    on_settle: OnSettle | str = OnSettle.FINISH,
    settings: OutboxSettings | None = None,
) -> Intent:
    """Record the intent to call *system* with *key*, or find the intent already recorded.

    Never commits — and the caller **must commit before calling the outside system**, in a
    transaction of its own: an intent rolled back with a crash would forget that we may
    have sent the request. ``Intent.created`` says whether to call now; when False, the
    recorded operation says what is known (settle it with :mod:`dedup.ledger.reconcile`, don't
    call again). *in_flight_grace*: seconds during which the pending call belongs to this
    process; a reconciler looks at it only afterwards. *run_id*: the agent run that waits on
    the outcome; whatever settles the operation settles that run too, as *on_settle* says
    (:class:`OnSettle`: ``finish`` it done/failed, the default, or ``resume`` it). A key
    already recorded keeps the run and choice it was recorded with.

    Raises:
        RequestMismatch: *key* was recorded for another request (or system/operation);
            nothing was written.
        ConfigurationError: empty key/system/operation, a request that is not JSON, or an
            unknown *on_settle*.
    """
    plan = begin_plan(
        key=key, system=system, operation=operation, request=request, run_id=run_id,
        message_id=None if message_id is None else str(message_id),
        in_flight_grace=in_flight_grace, store_request=store_request, actor=actor,
        on_settle=on_settle,
    )
    return run_plan(conn, plan, settings)


def record_outcome(
    conn: SyncConn,
    operation_id: uuid.UUID,
    outcome: Applied | Refused | Found,
    *,
    actor: str = "ledger",
    kind: str = "call",
    settings: OutboxSettings | None = None,
) -> Operation:
    """Record a definite answer: ``confirmed`` (Applied/Found) or ``rejected`` (Refused).

    Never commits. Applies only to an open operation (pending/unknown/not-applied); for one
    already settled or with a human, the answer is kept as a ``late-outcome`` event and the
    operation is returned unchanged. The run waiting on the operation (``run_id``) is
    settled in the same transaction (:func:`settle_run_plan`); the event says how.
    """
    return run_plan(conn, record_outcome_plan(operation_id, outcome, actor=actor, kind=kind),
                    settings)


def mark_unknown(
    conn: SyncConn,
    operation_id: uuid.UUID,
    *,
    reason: str,
    check_in: float = 0.0,
    actor: str = "ledger",
    settings: OutboxSettings | None = None,
) -> Operation:
    """Record that the call's outcome was not seen; a status query is due in *check_in* s.

    Never commits. A no-op (returning the operation) when it is no longer open.
    """
    return run_plan(conn, mark_unknown_plan(operation_id, reason=reason, actor=actor,
                                            check_in=check_in), settings)


def get_operation(
    conn: SyncConn,
    operation_id: uuid.UUID | None = None,
    *,
    key: str | None = None,
    settings: OutboxSettings | None = None,
) -> Operation:
    """The operation with this id or idempotency key; raises :class:`OperationNotFound`."""
    return run_plan(conn, get_operation_plan(operation_id, key), settings)


def operation_history(
    conn: SyncConn, operation_id: uuid.UUID, *, settings: OutboxSettings | None = None
) -> list[OperationEvent]:
    """Every event of the operation in order: the evidence of how its status was reached."""
    return run_plan(conn, events_plan(operation_id), settings)
