"""Light traffic: the records of clean batches written together (relay/grouped.py), against
the real PostgreSQL and Kafka, the relay in its own process."""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import Engine, text

from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from tests.e2e.conftest import (
    RelayProcesses,
    count_status,
    explain_missing,
    read_topic,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("kafka_client")


def trickle(engine: Engine, topic: str, count: int, *, pause_s: float,
            start: int = 0) -> list[str]:
    """*count* messages, one commit each, *pause_s* apart: an idle relay's traffic. Message
    i (from *start*) has key k{i % 3}."""
    ids = []
    for i in range(start, start + count):
        with engine.begin() as conn:
            ids.append(str(emit(conn, Envelope(topic=topic, type="t", key=f"k{i % 3}",
                                               payload={"i": i}))))
        time.sleep(pause_s)
    return ids


def records(engine: Engine) -> int:
    """Record statements so far: each writes its proofs with one transaction time."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(DISTINCT published_at) FROM outboxkit.deliveries")).scalar_one())


def in_order(found: list[str], sent: list[str]) -> bool:
    """*found* (Kafka's order, duplicates dropped) keeps the order of *sent* per key."""
    return [m for m in dict.fromkeys(found) if m in sent] == sent


@pytest.mark.parametrize(("group_ms", "fewer"), [(300, True), (0, False)])
def test_records_of_batches_acknowledged_together_are_one_statement(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses, group_ms: int, fewer: bool
) -> None:
    topic = f"grouped-{uuid.uuid4().hex[:8]}"
    relays.start(record_group_ms=group_ms)
    trickle(engine, topic, 1, pause_s=0)  # the topic is made; the relay is idle after it
    wait_until(lambda: count_status(engine, "published") == 1, 60, "the first message")
    before = records(engine)
    trickle(engine, topic, 30, pause_s=0.02)
    wait_until(lambda: count_status(engine, "published") == 31, 60, "31 published")
    made = records(engine) - before
    with engine.connect() as conn:
        unproven = conn.execute(text(
            "SELECT count(*) FROM outboxkit.message_status WHERE kafka_offset IS NULL"
        )).scalar_one()
    assert unproven == 0  # every message's proof is kept, grouped or not
    if fewer:
        assert made <= 10, made  # 30 batches in about 0.7 s, grouped by 0.3 s
    else:
        assert made >= 20, made  # about a record per wake-up


def test_a_relay_killed_with_records_held_loses_nothing(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    topic = f"held-{uuid.uuid4().hex[:8]}"
    # Long enough that the 15 are still held when the check below sees them all in Kafka,
    # however loaded the machine.
    victim = relays.start("victim", record_group_ms=8000)
    sent = trickle(engine, topic, 1, pause_s=0)
    wait_until(lambda: count_status(engine, "published") == 1, 60, "the first message")
    sent += trickle(engine, topic, 15, pause_s=0.02, start=1)
    # In Kafka, acknowledged, but their record held: the database still says pending.
    wait_until(lambda: len(read_topic(kafka_bootstrap, topic)) >= 16, 30, "16 in Kafka")
    assert count_status(engine, "pending") > 0, "the records were written before the kill"
    relays.kill(victim)
    relays.start("heir")
    wait_until(lambda: count_status(engine, "published") == 16, 60, "16 published")
    found = [dict(r.headers)["message-id"].decode()
             for r in sorted(read_topic(kafka_bootstrap, topic),
                             key=lambda r: (r.partition, r.offset))]
    missing = set(sent) - set(found)
    assert not missing, explain_missing(engine, kafka_bootstrap, topic, missing, relays.log_dir)
    assert len(found) > len(sent)  # the held ones were sent again: duplicates, same ids
    for k in range(3):
        of_key = sent[k::3]
        assert in_order([m for m in found if m in of_key], of_key), k
