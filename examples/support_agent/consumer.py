"""The reorder consumer: places each ``reorder`` the agent sends at the supplier, at most once.

    OUTBOXKIT_EXAMPLE_SUPPLIER_URL=http://127.0.0.1:8080 \\
        python -m consumers examples.support_agent.consumer:app

``ctx.perform`` goes through the operations ledger with an idempotency key derived from the
message id, so a redelivered message never places a second order. It carries the agent
run's id with ``on_settle="resume"``: once the supplier's answer is known, the same
transaction that records it confirms the run (the confirmation id is the message id, which
is what the run waits for) and makes it runnable again; the agent's ``reorder`` call then
returns that evidence (``status``, ``reference`` = the supplier's order id, ...).
"""

from __future__ import annotations

from consumers import Consumer, HandlerContext, RetryLater
from examples.supplier_order import config as supplier_config
from examples.support_agent import config
from examples.support_agent.agent import Reorder

app = Consumer(group_id=config.group_id())
UNSETTLED = frozenset({"pending", "unknown", "not-applied"})


def place_reorder(ctx: HandlerContext, reorder: Reorder) -> None:
    if ctx.run_id is None:
        raise ValueError(f"message {ctx.message_id} has no run-id header: not the agent's")
    op = ctx.perform(
        system=supplier_config.supplier().system(), operation="reorder",
        request=reorder.model_dump(mode="json"), run_id=ctx.run_id, on_settle="resume",
        policy=supplier_config.POLICY,
    )
    if op.status in UNSETTLED:  # no answer seen yet: come back; a status query settles it
        raise RetryLater(f"the reorder's outcome is {op.status}: reconciling", 1.0)


app.register(config.topic(), place_reorder)
