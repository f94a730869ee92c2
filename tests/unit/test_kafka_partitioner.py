"""The relay's partitioner sends each key where Kafka's default partitioner would."""

from __future__ import annotations

from typing import Any

from kafka.partitioner.default import DefaultPartitioner

from outbox.kafka import partitioner
from outbox.kafka.partitioner import CachedKeyPartitioner


class Cluster:
    def __init__(self, partitions: int) -> None:
        self.n = partitions

    def topics(self) -> set[str]:
        return {"t"}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return set(range(self.n))

    def available_partitions_for_topic(self, topic: str) -> set[int]:
        return set(range(self.n))


def test_same_partition_as_the_default_for_every_key_and_partition_count() -> None:
    cached, default = CachedKeyPartitioner(), DefaultPartitioner()
    for n in (1, 3, 6, 64):
        cluster = Cluster(n)
        for i in range(500):
            key = f"customer-{i}".encode()
            args: tuple[Any, ...] = ("t", None, key, None, None, cluster)
            assert cached.partition(*args) == default.partition(*args)
            assert cached.partition(*args) == default.partition(*args)  # from the cache


def test_the_cache_is_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(partitioner, "MAX_KEYS", 10)
    cached = CachedKeyPartitioner()
    for i in range(35):
        cached.partition("t", None, f"k{i}".encode(), None, None, Cluster(6))
    assert len(cached._hashes) <= 10


def test_a_message_without_key_goes_to_some_partition() -> None:
    assert CachedKeyPartitioner().partition("t", None, None, None, None, Cluster(6)) in range(6)
