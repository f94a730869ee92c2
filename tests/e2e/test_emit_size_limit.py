"""Emit's size limit against the relay's: what emit accepts, a relay with its defaults publishes.

Issue #13: with both defaults at 1,048,576 bytes, emit accepted a payload of 1,048,464 base64
characters that the relay's producer then refused ("1048669 bytes when serialized"): emit
counted key + payload + headers, the producer the whole record.
"""

from __future__ import annotations

import base64
import json
import random
import uuid

import pytest
from sqlalchemy import Engine, text

from outbox.errors import InvalidMessage
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope, encode
from outbox.settings import OutboxSettings
from tests.e2e.conftest import RelayProcesses, count_status, read_topic, wait_until


def envelope_of(topic: str, payload_chars: int, blob: str) -> Envelope:
    """An order whose payload is *payload_chars* base64 characters (random: lz4, the relay's
    default codec, cannot shrink them)."""
    return Envelope(
        topic=topic,
        type="order.submit",
        key="supplier-acme",
        payload={"attachment": blob[:payload_chars]},
        run_id=uuid.uuid4(),
        correlation_id="ticket-812",
    )


def largest_accepted(topic: str, blob: str, settings: OutboxSettings) -> int:
    """The most payload characters emit accepts under *settings* (a bisection on encode)."""
    low, high = 0, len(blob)
    while low < high:
        middle = (low + high + 1) // 2
        try:
            encode(envelope_of(topic, middle, blob), settings)
        except InvalidMessage:
            high = middle - 1
        else:
            low = middle
    return low


@pytest.mark.timeout(180)
def test_the_largest_message_emit_accepts_is_published_and_one_byte_more_is_refused(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    topic = f"big-{uuid.uuid4().hex[:8]}"
    defaults = OutboxSettings()
    blob = base64.b64encode(random.Random(13).randbytes(800_000)).decode()
    chars = largest_accepted(topic, blob, defaults)
    largest = envelope_of(topic, chars, blob)
    assert encode(largest, defaults).size == defaults.max_message_bytes

    with engine.begin() as conn:
        emit(conn, largest)
        with pytest.raises(InvalidMessage) as caught:
            emit(conn, envelope_of(topic, chars + 1, blob))
    assert caught.value.field == "message"
    assert f"is {defaults.max_message_bytes + 1} bytes as a Kafka record" in str(caught.value)
    assert f"over settings.max_message_bytes ({defaults.max_message_bytes})" in str(caught.value)

    relays.start()  # the relay's own defaults: max_request_bytes 1 MiB, lz4
    wait_until(
        lambda: count_status(engine, "published") + count_status(engine, "failed") == 1,
        60,
        "the relay to publish or refuse the message",
    )
    with engine.connect() as conn:
        status, error = conn.execute(
            text("SELECT status, last_error FROM outboxkit.message_status")
        ).one()
    assert (status, error) == ("published", None)
    [record] = read_topic(kafka_bootstrap, topic)
    assert record.key == b"supplier-acme"
    assert json.loads(record.value) == largest.payload
    assert dict(record.headers)["message-id"] == str(largest.message_id).encode()
