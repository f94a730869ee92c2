"""The order consumer: places each ``order.submit`` at the supplier at most once.

    OUTBOXKIT_EXAMPLE_SUPPLIER_URL=http://127.0.0.1:8080 \\
        python -m consumers examples.supplier_order.consumer:app

The call goes through the operations ledger (``ctx.perform``) with an idempotency key
derived from the message id, so a redelivery — after a crash, a rebalance, a retry — finds
the operation already recorded and never places a second order. The operation carries the
run's id, so whatever settles it settles the run too, in the same transaction, with the
supplier's evidence (``reference``, the operation id, calls and status checks):

* ``confirmed`` (the supplier answered, or a status query found the order after a
  timeout): the run is ``done``;
* ``rejected`` (a definite refusal): the run is ``failed`` with the refusal;
* ``needs-human`` (the supplier could not tell us): the run was escalated with the
  evidence; a person resolves the operation (``outbox ops resolve``), which settles the run;
* ``pending`` / ``unknown`` / ``not-applied`` (no answer seen yet): retry the message later;
  the redelivery reconciles by asking the supplier, and so does the reconciler process. The
  consumer does not dead-letter the message while its operation is open (only this
  message's partition waits), and whichever learns the outcome first settles the run.

So the handler has nothing to confirm itself; the dedup mark commits once the operation is
settled or with a person.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, Field

from consumers import Consumer, HandlerContext, RetryLater
from examples.supplier_order import config


class OrderSubmit(BaseModel):
    run_id: uuid.UUID
    item: str = Field(min_length=1)
    qty: int = Field(gt=0)


app = Consumer(group_id=config.group_id())
UNSETTLED = frozenset({"pending", "unknown", "not-applied"})


def place_order(ctx: HandlerContext, order: OrderSubmit) -> None:
    op = ctx.perform(
        system=config.supplier().system(), operation="place-order",
        request=order.model_dump(mode="json"), run_id=order.run_id, policy=config.POLICY,
    )
    if op.status in UNSETTLED:
        raise RetryLater(f"the order's outcome is {op.status}: reconciling", config.retry_delay(op))


app.register(config.topic(), place_order)
