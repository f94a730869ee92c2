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
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from consumers.metrics import ConsumerMetrics
from outbox.kafka import (
    CommitRefused,
    Consumer,
    KafkaClientError,
    RebalanceListener,
    TopicPartition,
)

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
        # Per batch, not per record: each partition's last offset in poll order (the later
        # one of a partition is the higher), then one update per partition.
        last = {(r.topic, r.partition): r.offset for r in records}
        with self._lock:
            for (topic, partition), offset in last.items():
                tp = TopicPartition(topic, partition)
                if tp not in self._revoked:
                    self.pending[tp] = max(self.pending.get(tp, 0), offset + 1)

    def advance(self, watermarks: Mapping[TopicPartition, int]) -> None:
        """Per-message mode: each partition's watermark (everything below it is done)."""
        with self._lock:
            for tp, offset in watermarks.items():
                if tp not in self._revoked and offset > self.pending.get(tp, -1):
                    self.pending[tp] = offset

    def uncommitted(self, partitions: Iterable[TopicPartition] | None) -> dict[TopicPartition, int]:
        with self._lock:
            chosen = set(self.pending) if partitions is None else set(partitions) & set(
                self.pending)
            return {tp: self.pending[tp] for tp in chosen
                    if self.committed.get(tp) != self.pending[tp]}

    def confirmed(self, offsets: Mapping[TopicPartition, int]) -> None:
        with self._lock:
            for tp, offset in offsets.items():
                if offset > self.committed.get(tp, -1):
                    self.committed[tp] = offset

    def commit(
        self, consumer: Consumer, partitions: Iterable[TopicPartition] | None = None
    ) -> bool:
        """Commit the uncommitted offsets (of *partitions*, default all) and wait; True if
        none are left."""
        offsets = self.uncommitted(partitions)
        if not offsets:
            return True
        try:
            consumer.commit(offsets)
        except CommitRefused as exc:
            # The group rebalanced under us: the new owner redelivers, the marks drop them.
            log.warning(
                "offset commit refused by a rebalance: %s",
                exc,
                extra={"event": "consumer.commit_failed"},
            )
            self.forget(offsets)
            return False
        except KafkaClientError as exc:
            log.warning(
                "offset commit failed, will retry: %s",
                exc,
                extra={"event": "consumer.commit_failed"},
            )
            return False
        self.confirmed(offsets)
        return True

    def commit_async(self, consumer: Consumer) -> None:
        """Send the uncommitted offsets without waiting (skipping ones already in flight)."""
        offsets = self.uncommitted(None)
        with self._lock:
            offsets = {tp: o for tp, o in offsets.items() if self._in_flight.get(tp) != o}
            self._in_flight.update(offsets)
        if not offsets:
            return

        def answered(sent: Mapping[TopicPartition, int], error: BaseException | None) -> None:
            with self._lock:
                for tp, offset in sent.items():
                    if self._in_flight.get(tp) == offset:
                        del self._in_flight[tp]
            if error is not None:
                log.debug("asynchronous offset commit failed (sent again later): %s", error,
                          extra={"event": "consumer.commit_failed"})
            else:
                self.confirmed(sent)

        consumer.commit_async(offsets, answered)

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


class Rebalance:
    """Commits what is done before partitions are revoked; never commits lost ones.

    The client commits :meth:`to_commit` before it gives the partitions up (kafka-python
    awaits it on its IO thread, heartbeats going on; librdkafka in its revocation callback).
    """

    def __init__(self, tracker: OffsetTracker, metrics: ConsumerMetrics) -> None:
        self.tracker, self.metrics = tracker, metrics

    def to_commit(self, revoked: Collection[TopicPartition]) -> Mapping[TopicPartition, int]:
        return self.tracker.uncommitted(revoked)

    def revoked(
        self,
        partitions: Collection[TopicPartition],
        committed: Mapping[TopicPartition, int],
        error: BaseException | None,
    ) -> None:
        if committed:
            self.tracker.confirmed(committed)
        if error is not None:
            log.warning("offset commit before revocation failed: %s", error,
                        extra={"event": "consumer.commit_failed"})
        self.tracker.revoke(partitions)
        self._drop_lag(partitions)
        log.info("partitions revoked: %s", _names(partitions),
                 extra={"event": "consumer.revoked"})

    def lost(self, partitions: Collection[TopicPartition]) -> None:
        self.tracker.revoke(partitions)
        self._drop_lag(partitions)
        log.warning("partitions lost: %s", _names(partitions), extra={"event": "consumer.lost"})

    def assigned(self, partitions: Collection[TopicPartition]) -> None:
        self.tracker.assign(partitions)
        log.info("partitions assigned: %s", _names(partitions),
                 extra={"event": "consumer.assigned"})

    def _drop_lag(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(tp.topic, str(tp.partition))


class Attached:
    """The rebalance listener as one client sees it: detached when the client is replaced,
    so that its late callbacks (its close() revoking) do not touch the new client's state."""

    def __init__(self, inner: RebalanceListener) -> None:
        self.inner = inner
        self._attached = True

    def detach(self) -> None:
        self._attached = False

    def to_commit(self, revoked: Collection[TopicPartition]) -> Mapping[TopicPartition, int]:
        return self.inner.to_commit(revoked) if self._attached else {}

    def revoked(self, partitions: Collection[TopicPartition],
                committed: Mapping[TopicPartition, int], error: BaseException | None) -> None:
        if self._attached:
            self.inner.revoked(partitions, committed, error)

    def lost(self, partitions: Collection[TopicPartition]) -> None:
        if self._attached:
            self.inner.lost(partitions)

    def assigned(self, partitions: Collection[TopicPartition]) -> None:
        if self._attached:
            self.inner.assigned(partitions)


def _names(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in partitions)) or "none"
