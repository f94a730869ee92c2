"""A small consumer app for the end-to-end tests, run as ``python -m consumers ...:app``.

Its handler writes one row per message to ``consumer_effects`` (no unique key, so a
repeated effect would show as a second row). Configured by environment variables:
``TEST_CONSUMER_TOPIC`` (the topic), ``TEST_CONSUMER_HANDLER_SLEEP`` (seconds per message,
to make a kill land mid-batch), ``TEST_CONSUMER_RETRY_LATER_S`` (items with ``fail="later"``
are parked for that long, in the processes given it).
"""

from __future__ import annotations

import os
import time

from pydantic import BaseModel
from sqlalchemy import text

from consumers import Consumer, DeadLetter, HandlerContext, RetryLater
from outbox.messages.envelope import Envelope

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS public.consumer_effects ("
    " message_id text NOT NULL, n integer NOT NULL, pid integer NOT NULL,"
    " at timestamptz NOT NULL DEFAULT clock_timestamp())"
)


FIXES_DDL = "CREATE TABLE IF NOT EXISTS public.consumer_fixes (n integer PRIMARY KEY)"


class Item(BaseModel):
    n: int
    fail: str | None = None  # "always" | "dead-letter" | "once" | "later" | "until-fixed"
    follow_up: str | None = None  # topic of a follow-up message to emit


app = Consumer(group_id="e2e-consumers")
_failed_once: set[str] = set()


def handle(ctx: HandlerContext, item: Item) -> None:
    ctx.conn.execute(
        text("INSERT INTO public.consumer_effects (message_id, n, pid) VALUES (:m, :n, :p)"),
        {"m": ctx.message_id, "n": item.n, "p": os.getpid()},
    )
    if item.follow_up:
        ctx.emit(
            Envelope(topic=item.follow_up, type="item.done", key=ctx.key, payload={"n": item.n})
        )
    if item.fail == "always":
        raise RuntimeError(f"item {item.n} always fails")
    if item.fail == "dead-letter":
        raise DeadLetter(f"item {item.n} is refused")
    if item.fail == "until-fixed" and not ctx.conn.execute(
            text("SELECT 1 FROM public.consumer_fixes WHERE n = :n"), {"n": item.n}).first():
        raise DeadLetter(f"item {item.n}: the supplier refuses it until someone fixes it")
    later = os.environ.get("TEST_CONSUMER_RETRY_LATER_S")  # set in the first process only
    if item.fail == "later" and later:
        raise RetryLater("not now", delay_s=float(later))
    if item.fail == "once" and ctx.message_id not in _failed_once:
        _failed_once.add(ctx.message_id)
        raise RetryLater("first attempt fails", delay_s=0.05)
    sleep = float(os.environ.get("TEST_CONSUMER_HANDLER_SLEEP", "0"))
    if sleep:
        time.sleep(sleep)


app.register(os.environ.get("TEST_CONSUMER_TOPIC", "e2e-items"), handle)
