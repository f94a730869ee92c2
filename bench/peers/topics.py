"""The benchmark's Kafka topics: made here, counted by end offsets, timed by LogAppendTime.

Both engines' topics stamp records with the broker's append time, so "first to last record
appended" and "commit to appended" are read from Kafka itself, the same way for both.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic

PARTITIONS = 6  # the relay's default topic_partitions


def create(bootstrap: str, names: list[str]) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=30_000)
    try:
        admin.create_topics(
            [
                NewTopic(name, PARTITIONS, 1,
                         topic_configs={"message.timestamp.type": "LogAppendTime"})
                for name in names
            ]
        )
    finally:
        admin.close()


def delete(bootstrap: str, names: list[str]) -> None:
    with contextlib.suppress(Exception):
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
        try:
            admin.delete_topics(names)
        finally:
            admin.close()


class Counter:
    """Records in one topic so far (the sum of its partitions' end offsets)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer: Any = KafkaConsumer(
            bootstrap_servers=bootstrap.split(","), group_id=None, enable_auto_commit=False
        )
        self.partitions = [TopicPartition(topic, p) for p in range(PARTITIONS)]

    def count(self) -> int:
        return sum(self._consumer.end_offsets(self.partitions).values())

    def close(self) -> None:
        self._consumer.close()


def append_span(bootstrap: str, topic: str) -> tuple[float, float]:
    """Wall-clock seconds of the first and the last record appended to *topic*: each
    partition's first and last record, read by offset, not the whole topic."""
    consumer: Any = KafkaConsumer(
        bootstrap_servers=bootstrap.split(","),
        group_id=None,
        enable_auto_commit=False,
        max_poll_records=1,
    )
    firsts: list[float] = []
    lasts: list[float] = []
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        ends = consumer.end_offsets(parts)
        for tp in parts:
            if ends[tp] == 0:
                continue
            for offset, into in ((0, firsts), (ends[tp] - 1, lasts)):
                into.append(_timestamp_at(consumer, tp, offset))
    finally:
        consumer.close()
    if not firsts:
        raise RuntimeError(f"topic {topic} is empty")
    return min(firsts), max(lasts)


def _timestamp_at(consumer: Any, tp: TopicPartition, offset: int) -> float:
    consumer.assign([tp])
    consumer.seek(tp, offset)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=1000, max_records=1).values():
            record = records[0]
            if record.timestamp_type != 1:
                raise RuntimeError(f"topic {tp.topic} does not stamp LogAppendTime")
            return float(record.timestamp) / 1000
    raise RuntimeError(f"no record at {tp.topic}[{tp.partition}]@{offset} within 30 s")


def append_times(bootstrap: str, topic: str, wanted: set[str]) -> dict[str, float]:
    """message-id header -> the broker's LogAppendTime (s), for every record of *topic*."""
    consumer: Any = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap.split(","),
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=5000,
    )
    found: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 120
        for record in consumer:
            mid = dict(record.headers or []).get("message-id", b"").decode()
            if mid in wanted:
                found[mid] = record.timestamp / 1000
            if len(found) == len(wanted) or time.monotonic() > deadline:
                break
    finally:
        consumer.close()
    return found


def differences(bootstrap: str, topic_a: str, topic_b: str) -> list[str]:
    """How two topics that should hold the same records differ: per partition counts, and
    partition 0 record by record (message-id header -> key, value). Record order within a
    partition may differ (the relay publishes lane by lane), per-key order may not."""
    consumer: Any = KafkaConsumer(
        bootstrap_servers=bootstrap.split(","), group_id=None, enable_auto_commit=False
    )
    try:
        counts = [
            [consumer.end_offsets([TopicPartition(t, p)])[TopicPartition(t, p)]
             for p in range(PARTITIONS)]
            for t in (topic_a, topic_b)
        ]
        problems = []
        if counts[0] != counts[1]:
            problems.append(f"records per partition: {topic_a} {counts[0]}, {topic_b} {counts[1]}")
        records = [_partition_records(consumer, t, 0, counts[i][0])
                   for i, t in enumerate((topic_a, topic_b))]
    finally:
        consumer.close()
    (a, a_order), (b, b_order) = records
    if a != b:
        both = a.keys() & b.keys()
        unequal = [m for m in both if a[m] != b[m]]
        problems.append(
            f"partition 0: {len(a.keys() - both)} records only in {topic_a}, "
            f"{len(b.keys() - both)} only in {topic_b}, {len(unequal)} with other key or "
            f"value bytes (e.g. {[(a[m], b[m]) for m in unequal[:1]]})"
        )
    elif a_order != b_order:
        keys = [k for k in a_order if a_order[k] != b_order.get(k)]
        problems.append(f"partition 0: {len(keys)} keys in another order (e.g. {keys[:3]})")
    return problems


Records = dict[str, tuple[bytes | None, bytes | None]]


def _partition_records(
    consumer: Any, topic: str, partition: int, end: int
) -> tuple[Records, dict[bytes | None, list[str]]]:
    """message-id -> (key, value), and each key's message ids in offset order."""
    tp = TopicPartition(topic, partition)
    consumer.assign([tp])
    consumer.seek(tp, 0)
    out: Records = {}
    per_key: dict[bytes | None, list[str]] = {}
    seen = 0
    deadline = time.monotonic() + 120
    while seen < end and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=1000).values():
            for record in batch:
                seen += 1
                mid = dict(record.headers or []).get("message-id", b"").decode()
                out[mid] = (record.key, record.value)
                per_key.setdefault(record.key, []).append(mid)
    return out, per_key
