"""Settling operations whose outcome we did not see: ask the outside system, never guess.

For each open operation that is due (``unknown``; ``pending`` past its in-flight grace, i.e.
its process died after — or while — sending; ``not-applied`` by a human's word):

* the status query finds it → ``confirmed`` with the system's evidence, and the run waiting
  on it is settled in the same transaction (:func:`dedup.ledger.operations.record_outcome`; so is
  the outcome of a call made again);
* it definitely does not → the call is made again **with the same idempotency key**
  (recorded as a ``retry`` event; at most ``max_calls`` calls in all);
* nobody can say (status endpoint down, timeout) → the next query is scheduled with backoff
  (``next_check_at``); after ``max_checks`` unclear answers or ``max_age_seconds`` the
  operation goes to ``needs-human`` with its events as evidence, and its agent run (if any)
  is moved to ``needs-human`` in the same transaction (``outbox.runs.lifecycle.move``).

Evidence is bounded (``ReconcilePolicy.evidence_*``): every answer is recorded with each
value clipped to ``evidence_max_value_bytes`` (head, size, sha256), and an escalation copies
the intent, the first call and the last ``evidence_last_events`` events, summarising the
ones between — an operation checked 200 times against a 1 MB error page stays readable.

Concurrency: a checker *claims* due rows with ``FOR UPDATE SKIP LOCKED`` in a short
transaction that pushes ``next_check_at`` forward by ``claim_seconds`` and bumps
``version``; the outside query runs outside any transaction; its answer is written only if
the row's ``version`` is still the claimed one (a human or another checker did not act in
between). A definite answer (Found) is written whenever the operation is still open.

:func:`reconcile_due` is the scheduler's job body (a plain function taking an engine);
:mod:`dedup.ledger.scheduler` wires it into APScheduler.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, extract, func, select, update

from dedup.ledger.operations import (
    OPEN,
    Operation,
    OperationStatus,
    event_insert,
    fetch,
    get_operation,
    operation_history,
    ops,
    record_outcome,
)
from dedup.ledger.outcomes import (
    Evidence,
    Found,
    NotFound,
    Unclear,
    bound_events,
    clip,
    clip_detail,
)
from dedup.ledger.policy import ReconcilePolicy
from dedup.ledger.systems import System, ask, send
from outbox.db.execution import SyncConn
from outbox.errors import OutboxError
from outbox.runs.checkpoints import json_value
from outbox.runs.lifecycle import move
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)
DEFAULT_POLICY = ReconcilePolicy()
_OPEN_VALUES = [s.value for s in OPEN]


@dataclass(frozen=True)
class ReconcileReport:
    """What one :func:`reconcile_due` pass did: how many it claimed, where they ended up."""

    claimed: int
    statuses: dict[str, int] = field(default_factory=dict)
    errors: int = 0


def claim_due(
    conn: SyncConn,
    *,
    claim_seconds: float,
    limit: int = 10,
    systems: Collection[str] | None = None,
    operation_id: uuid.UUID | None = None,
    due_only: bool = True,
    settings: OutboxSettings | None = None,
) -> list[Operation]:
    """Claim up to *limit* open operations that are due; never commits (commit promptly).

    Rows another checker has locked are skipped; a claimed row is not due again for
    *claim_seconds* and its ``version`` grows, which fences the claimer's later write.
    """
    now = func.now()
    due = select(ops.c.id).where(ops.c.status.in_(_OPEN_VALUES))
    if due_only:
        due = due.where(ops.c.next_check_at <= now)
    if systems is not None:
        due = due.where(ops.c.system.in_(list(systems)))
    if operation_id is not None:
        due = due.where(ops.c.id == operation_id)
    due_cte = (
        due.order_by(ops.c.next_check_at).limit(limit)
        .with_for_update(skip_locked=True).cte("due")
    )
    claimed = (
        update(ops)
        .where(ops.c.id == due_cte.c.id)
        .values(next_check_at=now + timedelta(seconds=claim_seconds),
                version=ops.c.version + 1, updated_at=now)
        .returning(*ops.c)
    )
    return [Operation.from_row(row) for row in fetch(conn, claimed, settings)]


def reconcile_operation(
    engine: Engine,
    operation_id: uuid.UUID,
    system: System,
    *,
    policy: ReconcilePolicy = DEFAULT_POLICY,
    actor: str = "reconciler",
    due_only: bool = True,
    settings: OutboxSettings | None = None,
) -> Operation:
    """Settle one operation now if it is open (and due, unless ``due_only=False``).

    Returns the operation as it stands afterwards; unchanged when it is settled, not due,
    or being checked by someone else right now.
    """
    with engine.begin() as conn:
        claimed = claim_due(conn, claim_seconds=policy.claim_seconds, limit=1,
                            operation_id=operation_id, due_only=due_only, settings=settings)
        if not claimed:
            return get_operation(conn, operation_id, settings=settings)
    return _settle(engine, claimed[0], system, policy=policy, actor=actor, settings=settings)


def reconcile_due(
    engine: Engine,
    systems: Mapping[str, System] | Iterable[System],
    *,
    policy: ReconcilePolicy = DEFAULT_POLICY,
    actor: str = "reconciler",
    limit: int = 10,
    settings: OutboxSettings | None = None,
) -> ReconcileReport:
    """One reconciliation pass over due operations of *systems* (the scheduler's job body).

    Safe to run in many processes at once (SKIP LOCKED claims, version-fenced writes). An
    error settling one operation is logged and leaves it to a later pass (its claim expires).
    """
    by_name = dict(systems) if isinstance(systems, Mapping) else {s.name: s for s in systems}
    with engine.begin() as conn:
        claimed = claim_due(conn, claim_seconds=policy.claim_seconds, limit=limit,
                            systems=list(by_name), settings=settings)
    statuses: Counter[str] = Counter()
    errors = 0
    for operation in claimed:
        try:
            settled = _settle(engine, operation, by_name[operation.system], policy=policy,
                              actor=actor, settings=settings)
        except Exception:
            errors += 1
            log.exception("reconciling operation %s failed", operation.id,
                          extra={"event": "dedup.reconcile_failed"})
            continue
        statuses[settled.status.value] += 1
    return ReconcileReport(claimed=len(claimed), statuses=dict(statuses), errors=errors)


# --- one claimed operation ------------------------------------------------------------------


def _settle(engine: Engine, claimed: Operation, system: System, *, policy: ReconcilePolicy,
            actor: str, settings: OutboxSettings | None) -> Operation:
    if claimed.status is OperationStatus.NOT_APPLIED:
        # A human established it was not applied: no need to ask, call again (same key).
        with engine.begin() as conn:
            current, _ = _lock(conn, claimed.id, settings)
            if current.version != claimed.version:
                return current  # resolved again (or claimed) meanwhile: not ours any more
            after, call = _prepare_retry(conn, current, policy=policy, actor=actor,
                                         answer=None, settings=settings)
    else:
        answer = _clipped(ask(system, claimed), policy)
        if isinstance(answer, Found):
            with engine.begin() as conn:
                return record_outcome(conn, claimed.id, answer, actor=actor, kind="check",
                                      settings=settings)
        with engine.begin() as conn:
            after, call = _record_answer(conn, claimed, answer, policy=policy, actor=actor,
                                         settings=settings)
    if not call:
        return after
    # A retry was recorded and committed: make the call (same key) and record its outcome.
    return send(engine, after, system, policy=policy, actor=actor, settings=settings)


def _record_answer(conn: SyncConn, claimed: Operation, answer: NotFound | Unclear, *,
                   policy: ReconcilePolicy, actor: str,
                   settings: OutboxSettings | None) -> tuple[Operation, bool]:
    """Write a NotFound/Unclear answer; True when a retry call is now ours to make."""
    current, age = _lock(conn, claimed.id, settings)
    if current.version != claimed.version or current.status not in OPEN:
        log.info("operation %s changed while it was checked; leaving it", claimed.id,
                 extra={"event": "dedup.check_superseded"})
        fetch(conn, event_insert(claimed.id, "check", _answer_name(answer),
                                 _answer_detail(answer) | {"superseded": True}, actor),
              settings)
        return current, False  # someone else's move (or retry): not ours to call
    if isinstance(answer, NotFound):
        return _prepare_retry(conn, current, policy=policy, actor=actor, answer=answer,
                              settings=settings)
    return _unclear(conn, current, answer, age=age, policy=policy, actor=actor,
                    settings=settings), False


def _clipped(answer: Found | NotFound | Unclear,
             policy: ReconcilePolicy) -> Found | NotFound | Unclear:
    """The answer with every value cut to the policy's limit: each one is written to an
    event (and Unclear's reason to ``last_error``), once per check."""
    limit = policy.evidence_max_value_bytes
    if isinstance(answer, Found):
        evidence = answer.evidence
        return Found(Evidence(reference=evidence.reference,
                              response_digest=evidence.response_digest,
                              detail=clip_detail(evidence.detail, limit)))
    if isinstance(answer, NotFound):
        return NotFound(clip_detail(answer.detail, limit))
    return Unclear(clip(answer.reason, limit))


def _answer_name(answer: Found | NotFound | Unclear) -> str:
    return {Found: "found", NotFound: "not-found", Unclear: "unclear"}[type(answer)]


def _answer_detail(answer: Found | NotFound | Unclear) -> dict[str, Any]:
    if isinstance(answer, Found):
        return answer.evidence.as_json()
    if isinstance(answer, NotFound):
        return dict(answer.detail)
    return {"reason": answer.reason}


def _lock(conn: SyncConn, operation_id: uuid.UUID,
          settings: OutboxSettings | None) -> tuple[Operation, float]:
    age = extract("epoch", func.now() - ops.c.created_at).label("age_seconds")
    rows = fetch(conn, select(ops, age).where(ops.c.id == operation_id).with_for_update(),
                 settings)
    return Operation.from_row(rows[0]), float(rows[0]["age_seconds"])


def _write(conn: SyncConn, current: Operation, settings: OutboxSettings | None,
           **values: Any) -> Operation:
    rows = fetch(
        conn,
        update(ops).where(ops.c.id == current.id, ops.c.version == current.version)
        .values(version=ops.c.version + 1, updated_at=func.now(), **values)
        .returning(*ops.c),
        settings,
    )
    return Operation.from_row(rows[0])  # the row is locked by _lock: the version holds


def _prepare_retry(conn: SyncConn, current: Operation, *, policy: ReconcilePolicy, actor: str,
                   answer: NotFound | None,
                   settings: OutboxSettings | None) -> tuple[Operation, bool]:
    """Record the not-found check and the retry (True: call now), or escalate (False)."""
    checks = current.checks
    if answer is not None:
        checks += 1
        fetch(conn, event_insert(current.id, "check", "not-found", dict(answer.detail), actor),
              settings)
        if current.calls >= policy.max_calls:
            return _escalate(conn, current, checks=checks, actor=actor, settings=settings,
                             policy=policy,
                             reason=f"not found after {current.calls} calls with the same key "
                                    f"(max_calls={policy.max_calls}); not calling again"), False
    retry = _write(
        conn, current, settings, status=OperationStatus.PENDING.value, calls=current.calls + 1,
        checks=checks, last_error=None,
        next_check_at=func.now() + timedelta(seconds=policy.in_flight_grace),
    )
    because = "status query: not found" if answer is not None else "resolved not-applied"
    fetch(conn, event_insert(current.id, "retry", OperationStatus.PENDING.value,
                             {"call": retry.calls, "idempotency_key": retry.idempotency_key,
                              "because": because}, actor), settings)
    log.info("operation %s not applied; calling again with key %s (call %d)", current.id,
             current.idempotency_key, retry.calls, extra={"event": "dedup.operation_retry"})
    return retry, True


def _unclear(conn: SyncConn, current: Operation, answer: Unclear, *, age: float,
             policy: ReconcilePolicy, actor: str, settings: OutboxSettings | None) -> Operation:
    checks = current.checks + 1
    fetch(conn, event_insert(current.id, "check", "unclear",
                             {"reason": answer.reason, "check": checks}, actor), settings)
    if checks >= policy.max_checks:
        reason = f"outcome still unclear after {checks} status queries: {answer.reason}"
        return _escalate(conn, current, checks=checks, reason=reason, actor=actor,
                         policy=policy, settings=settings)
    if policy.max_age_seconds is not None and age >= policy.max_age_seconds:
        reason = f"outcome still unclear {age:.0f} s after the intent: {answer.reason}"
        return _escalate(conn, current, checks=checks, reason=reason, actor=actor,
                         policy=policy, settings=settings)
    return _write(
        conn, current, settings, status=OperationStatus.UNKNOWN.value, checks=checks,
        last_error=answer.reason,
        next_check_at=func.now() + timedelta(seconds=policy.backoff(checks)),
    )


def _escalate(conn: SyncConn, current: Operation, *, checks: int, reason: str, actor: str,
              policy: ReconcilePolicy, settings: OutboxSettings | None) -> Operation:
    """``needs-human`` with its events as evidence; the run follows in this transaction.

    The events are bounded (:func:`dedup.ledger.outcomes.bound_events`): this evidence is copied
    into the operation row and the run's transition, and a human has to read it.
    """
    history = operation_history(conn, current.id, settings=settings)
    evidence = {
        "reason": reason,
        "operation_id": str(current.id),
        "idempotency_key": current.idempotency_key,
        "system": current.system,
        "operation": current.operation,
        "calls": current.calls,
        "checks": checks,
        **bound_events([event.as_json() for event in history],
                       keep_last=policy.evidence_last_events,
                       max_value_bytes=policy.evidence_max_value_bytes),
    }
    run_note = _move_run(conn, current, reason=reason, evidence=evidence, actor=actor,
                         settings=settings)
    escalated = _write(
        conn, current, settings, status=OperationStatus.NEEDS_HUMAN.value, checks=checks,
        evidence=json_value(evidence), last_error=reason, next_check_at=None,
    )
    fetch(conn, event_insert(current.id, "escalation", OperationStatus.NEEDS_HUMAN.value,
                             {"reason": reason, "run": run_note}, actor), settings)
    log.warning("operation %s needs a human: %s", current.id, reason,
                extra={"event": "dedup.operation_needs_human"})
    return escalated


def _move_run(conn: SyncConn, current: Operation, *, reason: str, evidence: dict[str, Any],
              actor: str, settings: OutboxSettings | None) -> str | None:
    """Move the operation's run to needs-human (operator path: nobody may hold its lease).

    A run that cannot move (a live lease, already needs-human, done) is left as it is and
    the reason is recorded in the escalation event: the operation's status is what counts.
    """
    if current.run_id is None:
        return None
    note = f"operation {current.operation} on {current.system} " \
           f"({current.idempotency_key}) needs a human: {reason}"
    savepoint = conn.begin_nested()
    try:
        move(conn, current.run_id, RunState.NEEDS_HUMAN, actor=actor, reason=note,
             evidence={"operation": evidence}, settings=settings)
    except OutboxError as exc:
        savepoint.rollback()
        return f"run {current.run_id} not moved: {exc}"
    savepoint.commit()
    return f"run {current.run_id} moved to needs-human"

