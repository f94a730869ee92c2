"""Kafka offsets: committed only after the database commit, on revocation, never when lost.

The processor reports each database commit; the tracker keeps the next offset per
partition until the runner commits it to Kafka. A rebalance that revokes partitions
commits theirs first (so the next owner starts after them); partitions *lost* (this
consumer was presumed dead) are forgotten without committing: another member may already
be ahead, and a redelivery is absorbed by the dedup marks anyway.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import AsyncConsumerRebalanceListener, OffsetAndMetadata, TopicPartition
from kafka import errors as kafka_errors

from consumers.metrics import ConsumerMetrics

log = logging.getLogger(__name__)


class OffsetTracker:
    """Next offsets whose messages are committed in PostgreSQL, and which of them Kafka has.

    ``pending`` holds, per partition, the offset after the last message whose database
    transaction committed; ``committed`` what Kafka confirmed. The loop sends offsets with
    :meth:`commit_async` (one round trip per batch saved); revocation and shutdown use the
    synchronous :meth:`commit`. A lost or failed asynchronous commit costs a redelivery,
    which the dedup marks absorb: the database, not Kafka, is the record of what was done.
    """

    def __init__(self) -> None:
        self.pending: dict[TopicPartition, int] = {}
        self.committed: dict[TopicPartition, int] = {}
        self._in_flight: dict[TopicPartition, int] = {}
        # Revoked and not assigned again: the handler thread may still finish a batch of
        # theirs, but their offsets are the next owner's to commit now.
        self._revoked: set[TopicPartition] = set()
        # The async callback and the rebalance listener run on kafka-python's IO thread,
        # ``done`` on the handler thread.
        self._lock = threading.Lock()

    def done(self, records: Sequence[Any]) -> None:
        with self._lock:
            for record in records:
                tp = TopicPartition(record.topic, record.partition)
                if tp not in self._revoked:
                    self.pending[tp] = max(self.pending.get(tp, 0), record.offset + 1)

    def uncommitted(self, partitions: Iterable[TopicPartition] | None) -> dict[Any, Any]:
        with self._lock:
            chosen = set(self.pending) if partitions is None else set(partitions) & set(
                self.pending)
            return {tp: OffsetAndMetadata(self.pending[tp], "", -1) for tp in chosen
                    if self.committed.get(tp) != self.pending[tp]}

    def confirmed(self, offsets: dict[Any, Any]) -> None:
        with self._lock:
            for tp, meta in offsets.items():
                if meta.offset > self.committed.get(tp, -1):
                    self.committed[tp] = meta.offset

    def commit(self, consumer: Any, partitions: Iterable[TopicPartition] | None = None) -> bool:
        """Commit the uncommitted offsets (of *partitions*, default all) and wait; True if
        none are left."""
        offsets = self.uncommitted(partitions)
        if not offsets:
            return True
        try:
            consumer.commit(offsets)
        except kafka_errors.CommitFailedError as exc:
            # The group rebalanced under us: the new owner redelivers, the marks drop them.
            log.warning(
                "offset commit refused by a rebalance: %s",
                exc,
                extra={"event": "consumer.commit_failed"},
            )
            self.forget(offsets)
            return False
        except kafka_errors.KafkaError as exc:
            log.warning(
                "offset commit failed, will retry: %s",
                exc,
                extra={"event": "consumer.commit_failed"},
            )
            return False
        self.confirmed(offsets)
        return True

    def commit_async(self, consumer: Any) -> None:
        """Send the uncommitted offsets without waiting (skipping ones already in flight)."""
        offsets = self.uncommitted(None)
        with self._lock:
            offsets = {tp: m for tp, m in offsets.items() if self._in_flight.get(tp) != m.offset}
            for tp, meta in offsets.items():
                self._in_flight[tp] = meta.offset
        if not offsets:
            return

        def answered(sent: dict[Any, Any], response: Any) -> None:
            with self._lock:
                for tp, meta in sent.items():
                    if self._in_flight.get(tp) == meta.offset:
                        del self._in_flight[tp]
            if isinstance(response, Exception):
                log.debug("asynchronous offset commit failed (sent again later): %s", response,
                          extra={"event": "consumer.commit_failed"})
            else:
                self.confirmed(sent)

        try:
            consumer.commit_async(offsets, callback=answered)
        except kafka_errors.KafkaError as exc:
            answered(offsets, exc)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        with self._lock:
            for tp in list(partitions):
                self.pending.pop(tp, None)
                self.committed.pop(tp, None)
                self._in_flight.pop(tp, None)

    def revoke(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget *partitions* and ignore their work done from now on, until assigned again."""
        partitions = list(partitions)
        self.forget(partitions)
        with self._lock:
            self._revoked.update(partitions)

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        with self._lock:
            self._revoked.difference_update(partitions)


class Rebalance(AsyncConsumerRebalanceListener):  # type: ignore[misc]
    """Commits what is done before partitions are revoked; never commits lost ones.

    kafka-python 3 runs the listener on its IO thread, where a blocking commit raises; so
    the listener is a coroutine and awaits the asynchronous commit (the IO loop, heartbeats
    included, keeps running meanwhile).
    """

    def __init__(self, consumer: Any, tracker: OffsetTracker, metrics: ConsumerMetrics) -> None:
        self.consumer, self.tracker, self.metrics = consumer, tracker, metrics

    async def on_partitions_revoked(self, revoked: Any) -> None:
        offsets = self.tracker.uncommitted(revoked)
        if offsets:
            try:
                await self.consumer.commit_async(offsets)
                self.tracker.confirmed(offsets)
            except Exception as exc:
                log.warning("offset commit before revocation failed: %s", exc,
                            extra={"event": "consumer.commit_failed"})
        self.tracker.revoke(revoked)
        self._drop_lag(revoked)
        log.info("partitions revoked: %s", _names(revoked), extra={"event": "consumer.revoked"})

    async def on_partitions_lost(self, lost: Any) -> None:
        self.tracker.revoke(lost)
        self._drop_lag(lost)
        log.warning("partitions lost: %s", _names(lost), extra={"event": "consumer.lost"})

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.tracker.assign(assigned)
        log.info("partitions assigned: %s", _names(assigned), extra={"event": "consumer.assigned"})

    def _drop_lag(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(tp.topic, str(tp.partition))


def _names(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in partitions)) or "none"
