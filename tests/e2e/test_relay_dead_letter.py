"""A refused message's dead-letter copy: its payload when it fits, else where to find it."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, text

from outbox.messages.envelope import Envelope
from tests.e2e.conftest import (
    TOO_LARGE,
    RelayProcesses,
    count_status,
    emit_batch,
    read_topic,
    wait_until,
)
from tests.e2e.test_relay_failures import make_topic

pytestmark = pytest.mark.usefixtures("kafka_client")


def blob(size: int) -> dict[str, str]:
    return {"blob": os.urandom(size // 2).hex()}  # random: compression cannot shrink it


def failed_row(engine: Engine, envelope: Envelope) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT id, payload, state, error AS last_error FROM outboxkit.outbox_failures"
                 " WHERE message_id = :m"), {"m": envelope.message_id}).one()


def test_a_payload_too_large_for_the_producer_leaves_an_empty_copy_that_says_where_it_is(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    topic = f"huge-{uuid.uuid4().hex[:8]}"
    huge = Envelope(topic=topic, type="t", key="k", payload=blob(30_000))
    emit_batch(engine, [huge, Envelope(topic=topic, type="t", key="k", payload={"after": 1})])
    relays.start(max_request_bytes=20_000)
    wait_until(lambda: count_status(engine, "failed") == 1, 60, "the huge message refused")
    wait_until(lambda: count_status(engine, "published") == 1, 60, "the next one published")
    row = failed_row(engine, huge)
    assert "MessageSizeTooLarge" in row.last_error
    dead = read_topic(kafka_bootstrap, topic + ".dlq")
    assert len(dead) == 1
    copy = dead[0]
    headers = dict(copy.headers)
    assert copy.value == b""
    assert headers["message-id"] == str(huge.message_id).encode()
    assert headers["x-outboxkit-outbox-id"] == str(row.id).encode()
    assert headers["x-outboxkit-payload-bytes"] == str(len(bytes(row.payload))).encode()
    note = headers["x-outboxkit-payload-omitted"].decode()
    assert f"outbox row {row.id}" in note
    assert "payload" in note
    assert len(bytes(row.payload)) > 30_000  # the full payload is kept with the failure


def test_a_payload_that_fits_the_producer_keeps_its_value_in_the_dead_letter_copy(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    """The topic refuses it (max.message.bytes), the dead-letter topic takes it whole."""
    topic = f"small-limit-{uuid.uuid4().hex[:8]}"
    make_topic(kafka_bootstrap, topic, **{"max.message.bytes": "4000"})
    # Close to the producer's limit: still sendable, so still worth keeping.
    poison = Envelope(topic=topic, type="t", key="k", payload=blob(17_000))
    emit_batch(engine, [poison])
    relays.start(max_request_bytes=20_000)
    wait_until(lambda: count_status(engine, "failed") == 1, 60, "the message refused")
    row = failed_row(engine, poison)
    wait_until(lambda: len(read_topic(kafka_bootstrap, topic + ".dlq")) == 1, 30,
               "the dead-letter copy")
    copy = read_topic(kafka_bootstrap, topic + ".dlq")[0]
    headers = dict(copy.headers)
    assert copy.value == bytes(row.payload)
    assert "x-outboxkit-payload-omitted" not in headers
    assert TOO_LARGE.search(headers["x-outboxkit-error"].decode())
