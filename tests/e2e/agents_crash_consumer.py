"""The supplier's side of tests/e2e/test_agents_crash.py, run as
``python -m consumers tests.e2e.agents_crash_consumer:app``.

Each reorder message is performed once: one row in ``public.agent_crash_effects`` (no unique
key, so a repeated effect would show as a second row), and the run that sent it is confirmed
in the same transaction (``ctx.confirm``: the confirmation id is the message id). A
redelivery is dropped by the consumer's dedup before the handler runs. The topic comes from
``AGENTS_CRASH_TOPIC``. This module does not import pydantic-ai: the consumer side needs none.
"""

from __future__ import annotations

import os

from pydantic import BaseModel
from sqlalchemy import text

from consumers import Consumer, HandlerContext

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS public.agent_crash_effects ("
    " message_id text NOT NULL, run_id uuid, item text NOT NULL, qty integer NOT NULL,"
    " pid integer NOT NULL)"
)


def reference(item: str, qty: int) -> str:
    """The supplier's reference for an order, the evidence of its confirmation (the tests'
    direct confirmations compute it alike, so every run gets the same answer)."""
    return f"PO-{item}-{qty}"


class Reorder(BaseModel):
    item: str
    qty: int


app = Consumer(group_id="agents-crash")


def handle(ctx: HandlerContext, order: Reorder) -> None:
    ctx.conn.execute(
        text("INSERT INTO public.agent_crash_effects (message_id, run_id, item, qty, pid) "
             "VALUES (:m, :r, :i, :q, :p)"),
        {"m": ctx.message_id, "r": ctx.run_id, "i": order.item, "q": order.qty,
         "p": os.getpid()},
    )
    ctx.confirm(outcome="running", evidence={"reference": reference(order.item, order.qty)})


app.register(os.environ.get("AGENTS_CRASH_TOPIC", "supplier.orders"), handle)
