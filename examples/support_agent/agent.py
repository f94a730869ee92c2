"""The support agent: a plain pydantic-ai agent whose one outside effect goes through the outbox.

``lookup_order`` is an ordinary tool: read-only, it runs inline. ``reorder`` is an effect:
calling it writes one Kafka message (through the outbox, with the run's move to ``waiting``,
in one transaction); the consumer places the order at the supplier at most once, and the run
resumes with the supplier's answer as the tool's return value. The model is the scripted
one of :mod:`.script`; :mod:`.real_model` builds the same agent on a real provider.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models import Model

from examples.support_agent import config
from examples.support_agent.script import scripted_model
from outbox_agents import Effects, OutboxDurability

# The shop's order book, as the read-only tool sees it.
ORDERS = {
    "A-1001": {"item": "espresso-grinder", "qty": 1, "in_stock": False},
    "A-1002": {"item": "milk-jug", "qty": 2, "in_stock": False},
    "A-1003": {"item": "tamper", "qty": 1, "in_stock": False},
    "A-1004": {"item": "descaler", "qty": 3, "in_stock": True},
}
INSTRUCTIONS = ("You are a shop's support agent. Look the customer's order up; if its item "
                "is out of stock, reorder it from the supplier; then answer the customer.")


class Reorder(BaseModel):
    """The message the ``reorder`` tool sends (and the consumer reads)."""

    order_id: str
    item: str
    qty: int


def lookup_order(order_id: str) -> dict[str, Any]:
    """Look up a customer's order: its item, quantity and whether the item is in stock."""
    if order_id not in ORDERS:
        return {"error": f"there is no order {order_id}"}
    return {"order_id": order_id, **ORDERS[order_id]}


effects = Effects()


@effects.effect(topic=config.topic(), key=lambda reorder: reorder.item)
def reorder(order_id: str, item: str, qty: int) -> Reorder:
    """Reorder *qty* of *item* from the supplier for the customer's order *order_id*; returns
    the supplier's answer (its order reference)."""
    return Reorder(order_id=order_id, item=item, qty=qty)


def support_agent(model: Model | str, *, name: str = "support",
                  lease_seconds: float = 5.0) -> Agent[None, str]:
    """The agent on *model*, made durable by the :class:`OutboxDurability` capability (its
    runs are outboxkit runs of the workflow named after the agent); the effect tools come in
    as the ``effects`` toolset. The short default lease lets a killed worker's run be taken
    over within seconds (a slow real model wants a longer one)."""
    return Agent(model, name=name, output_type=str, instructions=INSTRUCTIONS,
                 tools=[lookup_order], toolsets=[effects],
                 capabilities=[OutboxDurability(lease_seconds=lease_seconds)])


agent = support_agent(scripted_model())
