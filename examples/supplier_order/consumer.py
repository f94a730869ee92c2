"""The order consumer: places each ``order.submit`` at the supplier at most once.

    OUTBOXKIT_EXAMPLE_SUPPLIER_URL=http://127.0.0.1:8080 \\
        python -m consumers examples.supplier_order.consumer:app

The call goes through the operations ledger (:func:`dedup.perform`) with an idempotency key
derived from the message id, so a redelivery — after a crash, a rebalance, a retry — finds
the operation already recorded and never places a second order. Each outcome takes its own
path:

* ``confirmed`` (the supplier answered, or a status query found the order after a
  timeout): the run moves to ``done`` with the supplier's reference as evidence;
* ``rejected`` (a definite refusal): the run moves to ``failed`` with the refusal;
* ``pending`` / ``unknown`` (no answer seen): retry the message later; the redelivery
  reconciles by asking the supplier, and so does the reconciler process;
* ``needs-human`` (the supplier could not tell us): the run was escalated with the
  evidence; the message is done, a person resolves the operation (``outbox ops resolve``).

The run moves in the same transaction as the consumer's dedup mark.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from consumers import Consumer, HandlerContext, RetryLater
from dedup import Operation, perform
from examples.supplier_order import config


class OrderSubmit(BaseModel):
    run_id: uuid.UUID
    item: str = Field(min_length=1)
    qty: int = Field(gt=0)


app = Consumer(group_id=config.group_id())


def evidence_of(op: Operation) -> dict[str, object]:
    return {"supplier_ref": op.reference, "operation_id": str(op.id), "calls": op.calls,
            "status_checks": op.checks, "supplier_answer": op.evidence}


def retry_delay(op: Operation) -> float:
    """Come back when the ledger says the operation is next due (bounded to 0.2-2 s: the
    reconciler may settle it sooner)."""
    if op.next_check_at is None:
        return 1.0
    return min(2.0, max(0.2, (op.next_check_at - datetime.now(UTC)).total_seconds()))


def place_order(ctx: HandlerContext, order: OrderSubmit) -> None:
    op = perform(
        ctx.conn.engine, system=config.supplier().system(), operation="place-order",
        request=order.model_dump(mode="json"), message_id=ctx.message_id,
        run_id=order.run_id, policy=config.POLICY, actor=ctx.group_id,
    )
    if op.status == "confirmed":
        ctx.confirm(outcome="done", run_id=order.run_id, evidence=evidence_of(op),
                    reason="the supplier confirmed the order")
    elif op.status == "rejected":
        ctx.confirm(outcome="failed", run_id=order.run_id, evidence=evidence_of(op),
                    reason="the supplier refused the order")
    elif op.status != "needs-human":
        raise RetryLater(f"the order's outcome is {op.status}: reconciling", retry_delay(op))


app.register(config.topic(), OrderSubmit, place_order)
