"""What an operator does in the console, each through the function the CLI calls, in one
transaction, recorded with the operator's name as the actor. Each returns the sentence the
page shows; a refusal raises the library's own error (nothing written), whose words the page
shows as they are.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection
from typing import Any

from sqlalchemy import Engine

from consumers.deadletter import KafkaSender
from consumers.errors import ConsumerError
from consumers.failures import discard
from consumers.replay import republish
from dedup.ledger.ledger import Ledger
from dedup.ledger.outcomes import Evidence
from outbox.db.execution import run_plan
from outbox.kafka import KafkaClientError
from outbox.messages.backlog import retry_messages
from outbox.runs import children
from outbox.runs.approvals import grant, revoke
from outbox.runs.requeue import requeue
from outbox.settings import OutboxSettings


class BadInput(ValueError):
    """A form or JSON body that says something the action cannot take (nothing was done)."""


def need(value: str | None, what: str) -> str:
    if value is None or not value.strip():
        raise BadInput(f"{what} is required")
    return value.strip()


def evidence_of(raw: str | None, *, required: bool) -> Evidence | None:
    """The evidence field: a JSON object (``reference`` and ``response_digest`` are lifted
    out, as ``outbox ops resolve --evidence`` does)."""
    if raw is None or not raw.strip():
        if required:
            raise BadInput('evidence is required: a JSON object, e.g. {"reference": "PO-1"}')
        return None
    try:
        return Evidence.from_json(raw)
    except ValueError as exc:
        raise BadInput(f"evidence is {exc}" if str(exc).startswith("not JSON")
                       else f"evidence {exc}") from exc


def resolve(engine: Engine, settings: OutboxSettings, op_id: uuid.UUID, *, outcome: str,
            evidence: str | None, reason: str | None, actor: str) -> str:
    """``outbox ops resolve``: confirmed with evidence, or not applied with a reason. The
    ledger's compare-and-set refuses an operation someone settled a moment ago."""
    ledger = Ledger(settings=settings)
    if outcome == "confirmed":
        found = evidence_of(evidence, required=True)
        assert found is not None
        with engine.begin() as conn:
            done = ledger.resolve_confirmed(conn, op_id, evidence=found, actor=actor,
                                            reason=(reason or "").strip()
                                            or "confirmed with the evidence given")
    elif outcome == "not-applied":
        why = need(reason, "a reason (why you know it was not applied)")
        with engine.begin() as conn:
            done = ledger.resolve_not_applied(conn, op_id, actor=actor, reason=why,
                                              evidence=evidence_of(evidence, required=False))
    else:
        raise BadInput(f"outcome must be 'confirmed' or 'not-applied', not {outcome!r}")
    return f"operation {done.id} is {done.status.value} (by {actor})"


def grant_approval(engine: Engine, settings: OutboxSettings, approval_id: uuid.UUID, *,
                   reason: str | None, digest: str | None, actor: str) -> str:
    """``outbox approvals grant --reason``. *digest*: the call the page showed (its hidden
    field), refused if the approval binds another."""
    with engine.begin() as conn:
        grant(conn, approval_id, by=actor, reason=(reason or "").strip() or None,
              digest=(digest or "").strip() or None, settings=settings)
    return f"approval {approval_id} granted by {actor}; its run is woken"


def revoke_approval(engine: Engine, settings: OutboxSettings, approval_id: uuid.UUID, *,
                    reason: str | None, actor: str) -> str:
    why = need(reason, "a reason")
    with engine.begin() as conn:
        revoke(conn, approval_id, by=actor, reason=why, settings=settings)
    return f"approval {approval_id} revoked by {actor}"


def requeue_run(engine: Engine, settings: OutboxSettings, run_id: uuid.UUID, *,
                reason: str | None, force: bool, actor: str) -> str:
    why = need(reason, "a reason (why the run can go again)")
    with engine.begin() as conn:
        before, _ = requeue(conn, run_id, reason=why, actor=actor, force=force,
                            settings=settings)
    return f"run {run_id}: {before.value} → queued (by {actor})"


def cancel_run(engine: Engine, settings: OutboxSettings, run_id: uuid.UUID, *,
               reason: str | None, actor: str) -> str:
    why = need(reason, "a reason")
    with engine.begin() as conn:
        done = run_plan(conn, children.cancel_plan(run_id, actor=actor, reason=why,
                                                   settings=settings), settings)
    said: list[str] = []
    for run in done.moved:
        said.append(f"run {run.id} "
                    + ("compensating its effects" if run.compensating_since else "failed"))
    said += [f"run {held}: a worker holds it, not moved" for held in done.held]
    said += [f"run {undoing}: compensating already" for undoing in done.compensating]
    return "; ".join(said) or f"run {run_id}: nothing to cancel"


def replay(engine: Engine, settings: OutboxSettings, failure_id: int, *,
           kafka: Callable[[], KafkaSender], actor: str) -> str:
    """``outbox dlq replay``: the dead letter's exact bytes back to its topic, once (a
    compare-and-set: of two operators replaying it at once, one sends it)."""
    sender = kafka()
    try:
        sent = republish(engine, sender, failure_id, settings=settings, actor=actor)
    except KafkaClientError as exc:
        raise ConsumerError(f"failure {failure_id}: Kafka refused or did not answer ({exc}); "
                            "it is still dead-lettered") from exc
    finally:
        sender.close()
    return (f"failure {failure_id} republished to {sent.topic}[{sent.partition}]@{sent.offset} "
            f"by {actor}")


def discard_failure(engine: Engine, settings: OutboxSettings, failure_id: int, *,
                    reason: str | None, actor: str) -> str:
    """``outbox dlq discard``: never handled, with who and why (only a dead letter)."""
    why = need(reason, "a reason (why it will never be handled)")
    with engine.begin() as conn:
        discard(conn, failure_id, actor=actor, reason=why)
    return f"failure {failure_id} discarded by {actor}"


def retry(engine: Engine, settings: OutboxSettings, ids: Collection[Any]) -> str:
    try:
        wanted = sorted({int(i) for i in ids})
    except (TypeError, ValueError) as exc:
        raise BadInput("message ids are whole numbers (the outbox row ids)") from exc
    if not wanted:
        raise BadInput("say which messages to retry")
    with engine.begin() as conn:
        n = retry_messages(conn, wanted, settings=settings)
    return f"{n} message(s) will be sent again"
