"""Plain regression tests for the consumer bugs the input property found (real PostgreSQL,
records built by hand, no Kafka). Before the fixes, each of these records made
``Processor.process`` raise a database or encoding error on every redelivery: the consumer
stayed alive but its partition never moved again.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from consumers import Consumer, DeadLetter, HandlerContext
from consumers.deadletter import DROPPED_HEADER, Sent
from consumers.metrics import ConsumerMetrics
from consumers.processing import Processor
from outbox.db.schema import translate
from outbox.kafka import RecordTooLarge
from outbox.settings import OutboxSettings
from tests.e2e.consumer_support import settings
from tests.faults.properties.consumer_app import EFFECTS_DDL, handle

TOPIC = "orders"


@dataclass
class Record:
    offset: int
    value: bytes | None
    headers: list[tuple[str, bytes]]
    topic: str = TOPIC
    partition: int = 0
    key: bytes | None = b"k"


@dataclass
class Sender:
    """Records dead-letter copies; refuses the first *too_large* sends as Kafka would."""

    too_large: int = 0
    sent: list[tuple[bytes | None, bytes | None, dict[str, bytes]]] = field(default_factory=list)

    def __call__(self, topic: str, key: bytes | None, value: bytes | None,
                 headers: list[tuple[str, bytes]]) -> Sent:
        if self.too_large:
            self.too_large -= 1
            raise RecordTooLarge("MSG_SIZE_TOO_LARGE: the message is too large")
        self.sent.append((key, value, dict(headers)))
        return Sent(topic, 0, len(self.sent) - 1)


@pytest.fixture
def bound(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    return engine.execution_options(schema_translate_map=translate(OutboxSettings()))


def process(database_url: str, engine: Engine, sender: Sender, *records: Record) -> int:
    app = Consumer(f"g-{uuid.uuid4().hex[:6]}", settings=settings(database_url, "127.0.0.1:1"))
    app.register(TOPIC, handle)
    return Processor(app, engine, ConsumerMetrics(), sender).process(list(records)).handled


def failure(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(text("SELECT status, message_id, last_error, headers"
                                " FROM outboxkit.consumer_failures")).one()
    return dict(row._mapping)


def marks(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outboxkit.consumer_inbox")).scalar_one())


ORDER = json.dumps({"n": 1}).encode()


@pytest.mark.parametrize(
    ("message_id", "reason"),
    [
        (b"abc\x00def", "NUL"),
        # incompressible, and over what PostgreSQL's unique index on marks can hold
        (random.Random(1).randbytes(1500).hex().encode(), "over the 512"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_message_id_that_cannot_be_a_dedup_key_is_dead_lettered_not_retried_for_ever(
    database_url: str, bound: Engine, message_id: bytes, reason: str
) -> None:
    sender = Sender()
    assert process(database_url, bound, sender, Record(0, ORDER, [("message-id", message_id)])) == 1
    assert len(sender.sent) == 1
    found = failure(bound)
    assert found["status"] == "dead-lettered"
    assert found["message_id"] is None  # not stored: it is not a usable id
    assert reason in found["last_error"]
    assert marks(bound) == 0


def test_json_nested_too_deeply_to_parse_is_dead_lettered(
    database_url: str, bound: Engine
) -> None:
    deep = b'{"n": 1, "tags": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    sender = Sender()
    record = Record(0, deep, [("message-id", b"deep-1")])
    assert process(database_url, bound, sender, record) == 1
    assert "nested too deeply" in failure(bound)["last_error"]
    assert sender.sent[0][1] == deep


def test_nul_in_other_headers_is_stored_escaped_in_the_failures_table(
    database_url: str, bound: Engine
) -> None:
    headers = [("message-id", b"h-1"), ("tenant\x00", b"a\x00b")]
    assert process(database_url, bound, Sender(), Record(0, b"not json", headers)) == 1
    found = failure(bound)
    assert found["status"] == "dead-lettered"
    assert found["headers"]["tenant\\x00"] == "a\\x00b"


def test_an_error_quoting_a_nul_is_stored_and_sent_escaped(
    database_url: str, bound: Engine
) -> None:
    # extra="forbid": the unknown field's name, NUL and all, is quoted in the error
    value = json.dumps({"n": 1, "bad\u0000name": 2}).encode()
    sender = Sender()
    assert process(database_url, bound, sender, Record(0, value, [("message-id", b"e-1")])) == 1
    error = failure(bound)["last_error"]
    assert "bad\\x00name" in error
    assert b"bad\\x00name" in sender.sent[0][2]["x-outboxkit-error"]


class Echo(BaseModel):
    data: Any


def refuse(ctx: HandlerContext, echo: Echo) -> None:
    raise DeadLetter(f"cannot use {echo.data}")  # quotes the payload: a lone surrogate


def test_an_error_quoting_a_lone_surrogate_is_sent_and_stored_escaped(
    database_url: str, bound: Engine
) -> None:
    app = Consumer(f"g-{uuid.uuid4().hex[:6]}", settings=settings(database_url, "127.0.0.1:1"))
    app.register("echo", refuse)
    sender = Sender()
    record = Record(0, b'{"data": "x\\ud800y"}', [("message-id", b"s-1")], topic="echo")
    assert Processor(app, bound, ConsumerMetrics(), sender).process([record]).handled == 1
    assert b"x\\ud800y" in sender.sent[0][2]["x-outboxkit-error"]
    assert "x\\ud800y" in failure(bound)["last_error"]


def test_a_dead_letter_copy_too_large_for_kafka_is_sent_slim_and_the_bytes_kept(
    database_url: str, bound: Engine
) -> None:
    value = b'{"n": 1, "pad": "' + b"x" * 1000 + b'"}'
    sender = Sender(too_large=1)
    record = Record(0, value, [("message-id", b"big-1"), ("tenant", b"t")])
    assert process(database_url, bound, sender, record) == 1
    key, sent_value, headers = sender.sent[0]
    assert sent_value == b""
    assert DROPPED_HEADER in headers
    assert "tenant" not in headers
    assert headers["x-outboxkit-error"]
    assert key == b"k"
    with bound.connect() as conn:
        stored = conn.execute(text("SELECT payload, status FROM outboxkit.consumer_failures")).one()
    assert (bytes(stored.payload), stored.status) == (value, "dead-lettered")


def test_a_valid_record_after_the_bad_ones_is_applied_once(
    database_url: str, bound: Engine
) -> None:
    """The partition moves on: what follows poison is handled, in the same call."""
    records = [
        Record(0, ORDER, [("message-id", b"x\x00")]),
        Record(1, b"[" * 50_000, [("message-id", b"deep")]),
        Record(2, ORDER, [("message-id", b"good-1")]),
    ]
    assert process(database_url, bound, Sender(), *records) == 3
    with bound.connect() as conn:
        effects = conn.execute(text("SELECT message_id FROM public.property_effects")).all()
    assert [r[0] for r in effects] == ["good-1"]
