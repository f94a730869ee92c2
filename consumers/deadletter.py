"""Sending a message the consumer gave up on to ``<topic><suffix>``, with why and where from.

The copy keeps the original key, payload and headers and adds ``x-outboxkit-*`` headers
(error, original topic/partition/offset, group, attempts), like the relay's dead letters.
It is sent with acks=all and waited for: only then does the consumer move past it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from outbox.kafka import (
    Backend,
    KafkaClientError,
    Outgoing,
    Producer,
    ProducerOptions,
    RecordTooLarge,
    TopicExists,
)

log = logging.getLogger(__name__)

DROPPED_HEADER = "x-outboxkit-dropped"
ERROR_HEADERS = (
    DROPPED_HEADER,
    "x-outboxkit-error",
    "x-outboxkit-original-topic",
    "x-outboxkit-original-partition",
    "x-outboxkit-original-offset",
    "x-outboxkit-consumer-group",
    "x-outboxkit-attempts",
)


@dataclass(frozen=True)
class Sent:
    topic: str
    partition: int
    offset: int


def dead_letter_headers(
    record: Any, *, error: str, group: str, attempts: int
) -> list[tuple[str, bytes]]:
    kept = [(n, bytes(v or b"")) for n, v in record.headers or () if n not in ERROR_HEADERS]
    return [
        *kept,
        ("x-outboxkit-error", error[:4000].encode()),
        ("x-outboxkit-original-topic", record.topic.encode()),
        ("x-outboxkit-original-partition", str(record.partition).encode()),
        ("x-outboxkit-original-offset", str(record.offset).encode()),
        ("x-outboxkit-consumer-group", group.encode()),
        ("x-outboxkit-attempts", str(attempts).encode()),
    ]


def slim_copy(
    record: Any, headers: list[tuple[str, bytes]]
) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """Key, value and headers of a dead-letter copy that fits where the full one did not.

    A record near Kafka's size limit no longer fits once the error headers are added. The
    copy then carries the error headers only, with an empty value and no key unless it is
    small: the failures table keeps the key and value received, and the headers.
    """
    key = record.key if record.key is not None and len(record.key) <= 1024 else None
    ours = [(name, value) for name, value in headers if name in ERROR_HEADERS]
    note = b"key, value and headers: the copy was over the size limit; see consumer_failures"
    return key, b"", [*ours, (DROPPED_HEADER, note)]


class KafkaSender:
    """One idempotent producer for dead letters and replays; creates missing topics.

    ``send`` raises :class:`~outbox.kafka.RecordTooLarge` for a copy over the size limit
    and :class:`~outbox.kafka.KafkaClientError` for anything else Kafka refused."""

    def __init__(self, backend: Backend, *, client_id: str, timeout_s: float = 30.0) -> None:
        self._backend = backend
        self._client_id = client_id
        self._timeout_s = timeout_s
        self._producer: Producer | None = None
        self._known: set[str] = set()

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
    ) -> Sent:
        """Send and wait for the broker's acknowledgement."""
        self._ensure_topic(topic)
        if self._producer is None:
            self._producer = self._backend.producer(ProducerOptions(client_id=self._client_id))
        [delivery] = self._producer.send(
            [Outgoing(topic, key, value, headers)], timeout_s=self._timeout_s
        )
        error = delivery.error
        if error is None:
            return Sent(topic, delivery.partition, delivery.offset)
        # A refused record can leave the idempotent producer failing every later send.
        self._producer.close(timeout_s=0)
        self._producer = None
        text = str(error) if isinstance(error, KafkaClientError) else (
            f"{type(error).__name__}: {error}")
        if delivery.too_large:
            raise RecordTooLarge(text) from error
        raise KafkaClientError(text) from error

    def _ensure_topic(self, topic: str) -> None:
        if topic in self._known:
            return
        admin = self._backend.admin(f"{self._client_id}-admin")
        try:
            # -1: the broker's default partitions and replication (KIP-464).
            admin.create_topic(topic)
        except TopicExists:
            pass
        finally:
            admin.close()
        self._known.add(topic)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout_s=5)
