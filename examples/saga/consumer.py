"""Performs each effect and each undo at most once, through the operations ledger: its
settlement resumes (or, while it compensates, wakes) the run with the system's evidence.
``python -m consumers examples.saga.consumer:app``."""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from consumers import Consumer, HandlerContext, RetryLater
from dedup.ledger import System
from examples.saga import SYSTEMS, system_url, topic
from examples.supplier_client import SupplierClient
from examples.supplier_order.config import POLICY, retry_delay

app = Consumer(group_id=os.environ.get("OUTBOXKIT_EXAMPLE_GROUP", "checkout-effects"))


@cache
def systems() -> dict[str, System]:
    """The topic each system's messages come on, and the system as the ledger calls it."""
    return {topic(name): SupplierClient(system_url(name), timeout=1.5).system(name)
            for name in SYSTEMS}


def perform(ctx: HandlerContext, payload: dict[str, Any]) -> None:
    request = {"item": f"{payload['op']}:{payload['order']}"}
    if "compensates" in payload:  # an undo names what it undoes, by the system's own id
        request["undoes"] = payload["compensates"]["evidence"]["operations"][0]["reference"]
    op = ctx.perform(system=systems()[ctx.topic], operation=payload["op"], request=request,
                     run_id=ctx.run_id, on_settle="resume", policy=POLICY)
    if op.status in ("pending", "unknown", "not-applied"):
        raise RetryLater(f"{payload['op']} is {op.status}: reconciling", retry_delay(op))


for name in SYSTEMS:
    app.register(topic(name), perform)
