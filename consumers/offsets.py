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
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import ConsumerRebalanceListener, OffsetAndMetadata, TopicPartition
from kafka import errors as kafka_errors

from consumers.metrics import ConsumerMetrics

log = logging.getLogger(__name__)


class OffsetTracker:
    """Next offsets whose messages are committed in PostgreSQL but not yet in Kafka."""

    def __init__(self) -> None:
        self.pending: dict[TopicPartition, int] = {}

    def done(self, records: Sequence[Any]) -> None:
        for record in records:
            tp = TopicPartition(record.topic, record.partition)
            self.pending[tp] = max(self.pending.get(tp, 0), record.offset + 1)

    def commit(self, consumer: Any, partitions: Iterable[TopicPartition] | None = None) -> bool:
        """Commit the pending offsets (of *partitions*, default all); True if none are left."""
        chosen = set(self.pending) if partitions is None else set(partitions) & set(self.pending)
        if not chosen:
            return True
        offsets = {tp: OffsetAndMetadata(self.pending[tp], "", -1) for tp in chosen}
        try:
            consumer.commit(offsets)
        except kafka_errors.CommitFailedError as exc:
            # The group rebalanced under us: the new owner redelivers, the marks drop them.
            log.warning(
                "offset commit refused by a rebalance: %s",
                exc,
                extra={"event": "consumer.commit_failed"},
            )
            for tp in chosen:
                self.pending.pop(tp, None)
            return False
        except kafka_errors.KafkaError as exc:
            log.warning(
                "offset commit failed, will retry: %s",
                exc,
                extra={"event": "consumer.commit_failed"},
            )
            return False
        for tp in chosen:
            if self.pending.get(tp) == offsets[tp].offset:
                del self.pending[tp]
        return True

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self.pending.pop(tp, None)


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Commits what is done before partitions are revoked; never commits lost ones."""

    def __init__(self, consumer: Any, tracker: OffsetTracker, metrics: ConsumerMetrics) -> None:
        self.consumer, self.tracker, self.metrics = consumer, tracker, metrics

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.tracker.commit(self.consumer, revoked)
        self.tracker.forget(revoked)
        self._drop_lag(revoked)
        log.info("partitions revoked: %s", _names(revoked), extra={"event": "consumer.revoked"})

    def on_partitions_lost(self, lost: Any) -> None:
        self.tracker.forget(lost)
        self._drop_lag(lost)
        log.warning("partitions lost: %s", _names(lost), extra={"event": "consumer.lost"})

    def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("partitions assigned: %s", _names(assigned), extra={"event": "consumer.assigned"})

    def _drop_lag(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(tp.topic, str(tp.partition))


def _names(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in partitions)) or "none"
