"""Kafka's default partitioning (murmur2 of the key, as the Java client does), with each
key's hash remembered: kafka-python computes murmur2 in pure Python on every send, a
fifteenth of the relay's loop, and an outbox has far fewer keys than messages."""

from __future__ import annotations

from typing import Any

from kafka.partitioner.default import DefaultPartitioner, murmur2

MAX_KEYS = 65_536  # bounded memory: the table is dropped whole when it is full


class CachedKeyPartitioner(DefaultPartitioner):  # type: ignore[misc]
    def __init__(self) -> None:
        self._hashes: dict[bytes, int] = {}

    def partition(  # noqa: PLR0917 - kafka-python calls it with six positional arguments
        self, topic: str, key: Any, serialized_key: bytes | None, value: Any,
        serialized_value: Any, cluster: Any,
    ) -> int:
        if serialized_key is None:
            return int(super().partition(topic, key, serialized_key, value, serialized_value,
                                         cluster))
        if topic not in cluster.topics():
            raise ValueError(f"Topic {topic} not found in ClusterMetadata")
        hashed = self._hashes.get(serialized_key)
        if hashed is None:
            if len(self._hashes) >= MAX_KEYS:
                self._hashes.clear()
            hashed = self._hashes[serialized_key] = murmur2(serialized_key) & 0x7FFFFFFF
        # The partition count is read every time: a topic that grows is followed at once.
        partitions = sorted(cluster.partitions_for_topic(topic))
        return int(partitions[hashed % len(partitions)])
