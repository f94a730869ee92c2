"""kafka-python hands back what it fetched for a partition once that partition is resumed.

The sequence behind a partition that stopped for good after a retry parked it
(outbox/kafka/kafka_python_fixes.py): records of several partitions are fetched, one
partition is paused and sought back while its fetched data is kept, other partitions' records are
taken in full, and the partition is resumed. kafka-python 3.0 gives the kept data back only when no
records are "next in line", and emptied records of another partition stay next in line,
so the partition was never fetched again. Real broker, one consumer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import Fetcher

from outbox.kafka import kafka_python_fixes as kafka_fix


@pytest.fixture
def consumer(kafka_bootstrap: str, kafka_topic: Callable[..., str]) -> Iterator[KafkaConsumer]:
    topic = kafka_topic(partitions=3)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for partition in range(3):
        for i in range(20):
            producer.send(topic, b"m%d" % i, partition=partition)
    producer.flush(timeout=30)
    producer.close()
    kafka_fix.install()
    found = KafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=f"pause-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    found.subscribe([topic])
    try:
        yield found
    finally:
        found.close(autocommit=False)


def _offsets_after_a_pause(consumer: KafkaConsumer, seconds: float = 8) -> list[int]:
    """Poll; pause the first partition that returns records, seek it back to its first
    record, resume it a second later; return the offsets that partition handed over."""
    paused: TopicPartition | None = None
    paused_at = 0.0
    offsets: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for tp, records in consumer.poll(timeout_ms=200, max_records=7).items():
            if paused is None:
                paused, paused_at = tp, time.monotonic()
                consumer.pause(tp)
                consumer.seek(tp, records[0].offset)
            elif tp == paused:
                offsets.extend(r.offset for r in records)
        if paused is not None and paused in consumer.paused() and (
                time.monotonic() - paused_at > 1):
            consumer.resume(paused)
        if paused is not None and time.monotonic() - paused_at > seconds:
            break
        if len(offsets) >= 20:
            break
    return offsets


def test_a_resumed_partition_is_read_again_from_where_it_was_sought(
    consumer: KafkaConsumer,
) -> None:
    assert _offsets_after_a_pause(consumer) == list(range(20))


def test_without_the_fix_kafka_python_never_reads_it_again(
    consumer: KafkaConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the fix is for; if a kafka-python release stops doing this, the fix can go.
    original = Fetcher.__dict__["fetched_records"].__wrapped__
    monkeypatch.setattr(Fetcher, "fetched_records", original)
    assert _offsets_after_a_pause(consumer, seconds=4) == []
