"""A success without an offset is no proof (outbox.kafka.api.no_offset), with either client.

librdkafka reported records delivered, without an offset, that were never written: their
batch was refused by a partition leader not serving yet, and a later batch was accepted
("implicitly acked"). The relay recorded them published; they were lost (seen in
tests/e2e/test_relay_crashes.py under load: the first records of a topic just created).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from confluent_kafka import Message

from outbox.kafka.api import Delivery, Outgoing, no_offset
from outbox.kafka.confluent.producer import _Answer
from outbox.kafka.kafka_python import KafkaPythonProducer
from relay.claims import OutboxRow

RD_KAFKA_OFFSET_INVALID = -1001  # what librdkafka gives an implicitly acked record


def test_confluent_a_delivery_without_an_offset_is_a_transient_error() -> None:
    answer = _Answer()
    answer(None, Message(topic="t", partition=5, offset=RD_KAFKA_OFFSET_INVALID))
    assert answer.error is not None
    assert getattr(answer.error, "code", None) == "_NO_OFFSET"
    assert not answer.permanent  # sent again, not parked
    assert answer.offset == -1


def test_confluent_a_delivery_with_its_offset_is_the_proof() -> None:
    answer = _Answer()
    answer(None, Message(topic="t", partition=5, offset=7))
    assert (answer.error, answer.partition, answer.offset) == (None, 5, 7)


@dataclass
class _Meta:
    partition: int
    offset: int


@dataclass
class _Done:
    value: _Meta
    is_done: bool = True
    exception: BaseException | None = None

    def failed(self) -> bool:
        return False


class _Sender:
    """kafka-python's producer, answering each send with the next metadata."""

    def __init__(self, answers: list[_Meta]) -> None:
        self.answers = answers

    def send(self, topic: str, **_: Any) -> _Done:
        return _Done(self.answers.pop(0))

    def flush(self, timeout: float) -> None:
        pass


def test_kafka_python_a_delivery_without_an_offset_is_a_transient_error() -> None:
    producer = object.__new__(KafkaPythonProducer)  # only send's sorting is exercised
    producer._producer = _Sender([_Meta(2, 4), _Meta(2, -1)])
    sent, unproven = producer.send([Outgoing("t", b"k", b"v", []), Outgoing("t", b"k", b"w", [])],
                                   timeout_s=1)
    assert (sent.error, sent.partition, sent.offset) == (None, 2, 4)
    assert getattr(unproven.error, "code", None) == "_NO_OFFSET"
    assert not unproven.permanent


def test_the_relay_sends_such_a_record_again_and_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.publisher import Publisher  # noqa: PLC0415
    from relay.settings import RelaySettings  # noqa: PLC0415

    publisher = Publisher(RelaySettings(database_url="postgresql://u@127.0.0.1:1/x",
                                        kafka_bootstrap="127.0.0.1:1",
                                        kafka_client="confluent"))  # made without a broker
    try:
        monkeypatch.setattr(publisher.producer, "send",
                            lambda records, **_: [Delivery(error=no_offset()) for _ in records])
        row = OutboxRow(7, uuid.uuid4(), "t", b"k", "t", b"{}", {}, datetime.now(UTC), 0)
        with caplog.at_level(logging.ERROR, logger="relay.publisher"):
            published, [failed] = publisher.send([row])
    finally:
        publisher.close(timeout_s=1)
    assert published == []
    assert not failed.permanent  # read and sent again, never recorded as published
    assert "_NO_OFFSET" in failed.error
    [said] = [r for r in caplog.records if getattr(r, "event", None) == "relay.no_offset"]
    assert str(row.message_id) in said.getMessage()

