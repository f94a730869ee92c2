"""Handlers without a model get what was sent, through real Kafka: bytes as they were, JSON as
parsed (the annotation decides; tests/unit/test_consumer_annotations.py has every kind)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from consumers import Consumer, HandlerContext
from tests.e2e.conftest import wait_until
from tests.e2e.consumer_support import InProcess, produce, settings

pytestmark = pytest.mark.timeout(120)

RAW = b"\x00\xffnot JSON, not UTF-8\n"
DATA = {"item": "bolt", "qty": 2, "tags": ["a", "b"], "note": None}


def test_a_bytes_handler_and_a_dict_batch_handler_get_what_was_sent(
    database_url: str, kafka_bootstrap: str, kafka_topic: Callable[..., str]
) -> None:
    raw_topic, json_topic = kafka_topic(), kafka_topic()
    produce(kafka_bootstrap, raw_topic, [RAW])
    produce(kafka_bootstrap, json_topic, [DATA])
    got: dict[str, list[Any]] = {raw_topic: [], json_topic: []}
    app = Consumer(f"g-{uuid.uuid4().hex[:8]}", settings=settings(database_url, kafka_bootstrap))

    @app.handler(raw_topic)
    def keep(ctx: HandlerContext, value: bytes) -> None:
        got[ctx.topic].append(value)

    @app.batch_handler(json_topic)
    def parse(items: Sequence[tuple[HandlerContext, dict[str, Any]]]) -> None:
        for ctx, data in items:
            got[ctx.topic].append(data)

    with InProcess(app):
        wait_until(lambda: all(got.values()), 60, "both messages handled")
    assert got == {raw_topic: [RAW], json_topic: [DATA]}
