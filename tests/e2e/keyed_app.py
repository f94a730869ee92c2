"""A per-message consumer app for the per-key tests, run as ``python -m consumers ...:app``.

Each message is ``{"key": k, "seq": i}`` under Kafka key ``k``; the handler writes one row
to ``keyed_effects`` (no unique key: a repeated effect shows as a second row; ``id`` is the
order rows were written in) after waiting a random 0..``TEST_KEYED_SLEEP_MS`` ms (an
outside call). Messages of key ``TEST_KEYED_FAILING`` always ask to be retried later.
"""

from __future__ import annotations

import os
import random
import time

from pydantic import BaseModel
from sqlalchemy import text

from consumers import Consumer, HandlerContext, RetryLater

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS public.keyed_effects (id bigserial PRIMARY KEY,"
    " message_id text NOT NULL, k text, seq integer NOT NULL, part integer NOT NULL,"
    " pid integer NOT NULL)"
)


class Item(BaseModel):
    key: str | None
    seq: int


app = Consumer(group_id="keyed")


def handle(ctx: HandlerContext, item: Item) -> None:
    if item.key is not None and item.key == os.environ.get("TEST_KEYED_FAILING"):
        raise RetryLater("this key's supplier is down", delay_s=0.2)
    sleep_ms = float(os.environ.get("TEST_KEYED_SLEEP_MS", "0"))
    if sleep_ms:
        time.sleep(random.uniform(0, sleep_ms) / 1000)
    ctx.conn.execute(
        text("INSERT INTO public.keyed_effects (message_id, k, seq, part, pid)"
             " VALUES (:m, :k, :s, :part, :p)"),
        {"m": ctx.message_id, "k": item.key, "s": item.seq, "part": ctx.partition,
         "p": os.getpid()},
    )


app.register(os.environ.get("TEST_CONSUMER_TOPIC", "keyed-items"), handle)
