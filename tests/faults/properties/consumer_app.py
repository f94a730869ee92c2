"""The consumer the input-fault property runs, as ``python -m consumers ...consumer_app:app``.

Its model is strict (unknown fields refused; ``n`` fits the integer column, ``label`` is
plain text), so that "wrong schema" has many shapes. Its handler records one row per message
in ``property_effects`` (no unique key: a repeated effect would show as a second row). The
topic comes from ``PROPERTY_CONSUMER_TOPIC``.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text

from consumers import Consumer, HandlerContext

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS public.property_effects ("
    " message_id text NOT NULL, n integer NOT NULL, label text NOT NULL)"
)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(ge=-(2**31), lt=2**31)
    label: str = Field(default="", pattern=r"^[A-Za-z0-9 _.-]*$")
    tags: dict[str, int] = Field(default_factory=dict)


app = Consumer(group_id="property-consumer")


def handle(ctx: HandlerContext, order: Order) -> None:
    ctx.conn.execute(
        text("INSERT INTO public.property_effects (message_id, n, label) VALUES (:m, :n, :l)"),
        {"m": ctx.message_id, "n": order.n, "l": order.label},
    )


app.register(os.environ.get("PROPERTY_CONSUMER_TOPIC", "property-orders"), handle)
