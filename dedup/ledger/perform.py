"""The common path in one call: record the intent, call, record the outcome.

Transactions (each short, none open while the outside system is called)::

    T1  begin()            INSERT operations (pending) + intent event     COMMIT
        system.call(op)    the outside call, with op.idempotency_key
    T2  record_outcome()   confirmed / rejected + evidence               COMMIT
        or mark_unknown()  unknown, next_check_at = now() + backoff       COMMIT

A crash between T1 and T2 leaves ``pending``: a reconciler (or the next delivery of the same
message) asks the outside system instead of calling again. Found on a second call with the
same key, the operation is returned as recorded if settled, or reconciled if it is open and
due — the outside system is called again only after a definite *not found*.

The run that waits
------------------
With ``run_id=``, whatever settles the operation settles that run in the same transaction:
T2 above when the call answers, a reconciler's transaction when a status query does, a
person's when they resolve it (:func:`dedup.ledger.operations.settle_run_plan`). ``on_settle``
says how: ``"finish"`` (default) — confirmed → ``done``, rejected → ``failed``, with the
outside system's evidence; ``"resume"`` — back to ``running`` for the worker's next claim.
The confirmation id is the message id, so a handler that also calls ``ctx.confirm(...)``
after :func:`perform` returned a settled operation gets False (already applied).

Inside a Kafka consumer
-----------------------
Call :func:`perform` with an ``Engine`` (it opens its own connections), not with the
connection of the message's transaction — the intent must be committed on its own, before
the call. Then, in the message transaction, commit the dedup mark **after** the outcome is
recorded (with ``run_id=`` the run is already settled; without it, act on the result). If
the operation is still open (``pending``/``unknown``), do not commit the mark: let the
message be redelivered (retry later); the redelivery finds the operation by its key
(derived from the message id) and reconciles instead of calling — and should the message
be dead-lettered first, the reconciler still settles the operation and its run.
``needs-human``: the run was escalated with it; a person resolves the operation.
Do not hold a lock on the operation's agent run while calling :func:`perform`: settling or
escalating moves that run in perform's own transactions.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import Engine

from dedup.ledger.operations import OPEN, OnSettle, Operation, begin, idempotency_key
from dedup.ledger.policy import ReconcilePolicy
from dedup.ledger.reconcile import DEFAULT_POLICY, reconcile_operation
from dedup.ledger.systems import System, send
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings


def perform(
    engine: Engine,
    *,
    system: System,
    operation: str,
    request: Any,
    message_id: uuid.UUID | str | None = None,
    key: str | None = None,
    run_id: uuid.UUID | None = None,
    on_settle: OnSettle | str = OnSettle.FINISH,
    policy: ReconcilePolicy = DEFAULT_POLICY,
    actor: str = "perform",
    settings: OutboxSettings | None = None,
) -> Operation:
    """Do *operation* on *system* at most once per key; return the operation as recorded.

    The key is *key*, or :func:`~dedup.ledger.operations.idempotency_key` of *message_id* and
    *operation*. Check ``result.status``: ``confirmed`` / ``rejected`` are settled (with
    evidence); ``pending`` / ``unknown`` mean the outcome is not established yet (a
    reconciler will ask the system); ``needs-human`` means a person must decide.

    *run_id*: the agent run waiting on the outcome. It is settled with the operation, in
    the same transaction, as *on_settle* says: ``"finish"`` (confirmed → done, rejected →
    failed) or ``"resume"`` (back to running for its worker's next claim).

    Raises:
        RequestMismatch: the key was recorded for a different request; nothing was written.
        ConfigurationError: no key or message id, or an unknown *on_settle*.
    """
    if key is None:
        if message_id is None:
            raise ConfigurationError("perform needs key= or message_id= (to derive the key)")
        key = idempotency_key(message_id, operation)
    with engine.begin() as conn:
        intent = begin(
            conn, key=key, system=system.name, operation=operation, request=request,
            run_id=run_id, message_id=message_id, in_flight_grace=policy.in_flight_grace,
            actor=actor, on_settle=on_settle, settings=settings,
        )
    if intent.created:
        return send(engine, intent.operation, system, policy=policy, actor=actor,
                    settings=settings)
    if intent.operation.status not in OPEN:
        return intent.operation
    return reconcile_operation(engine, intent.operation.id, system, policy=policy, actor=actor,
                               settings=settings)
