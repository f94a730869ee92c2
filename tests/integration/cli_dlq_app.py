"""A consumer app for `outbox dlq replay --rehandle` tests: records each order it handles."""

from __future__ import annotations

from pydantic import BaseModel
from sqlalchemy import text

from consumers import Consumer, HandlerContext

app = Consumer(group_id="orders")


class Order(BaseModel):
    item: str


@app.handler("order.submit")
def place(ctx: HandlerContext, order: Order) -> None:
    if order.item == "poison":
        raise ValueError("still cannot handle poison")
    ctx.conn.execute(text("INSERT INTO public.cli_orders (message_id, item) VALUES (:m, :i)"),
                     {"m": ctx.message_id, "i": order.item})
