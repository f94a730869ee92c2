"""Partitions held back while one of their messages waits for another attempt.

A message that failed (its handler raised, or asked to ``RetryLater``) must be retried
before anything after it in its partition, but it must not hold up the other partitions:
the outside system one order hangs on says nothing about the others. So instead of
sleeping, the processor reports the message as *parked*; the loop seeks its partition back
to it and pauses the partition (Kafka's pause/resume: fetching stops, the group membership
and the other partitions go on). When the retry is due the partition is resumed, the
message is read again, and the processor takes it as a retry (alone, counted in the
failures table). Offsets of a parked partition stay where they were: nothing after the
parked message is handled, so nothing after it is committed.

The lot belongs to the loop's thread (the one that owns the Kafka consumer). A rebalance
may take a parked partition away, or give it back with fresh state (unpaused, read from
the committed offset), or keep it with its state (kafka-python keeps the position and the
pause of a partition assigned again): :meth:`ParkingLot.sync`, after every poll, makes the
lot agree with the consumer before anything is filtered.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from outbox.kafka import TopicPartition


@dataclass(frozen=True)
class Parked:
    """A failed message to try again at *due* (``time.monotonic()``), its partition paused."""

    topic: str
    partition: int
    offset: int
    due: float

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


class ParkingLot:
    """Which partitions are paused until when, and which offsets are retries when read."""

    def __init__(self) -> None:
        self._parked: dict[TopicPartition, Parked] = {}
        # Resumed partitions whose first record (at this offset) is a retry of a parked message.
        self._retrying: dict[TopicPartition, int] = {}

    def __len__(self) -> int:
        """Partitions held back by a failed message: paused, or resumed for its retry."""
        return len(self._parked.keys() | self._retrying.keys())

    def park(self, consumer: Any, parked: Parked) -> None:
        """Hold *parked*'s partition back from its message on, until it is due."""
        tp = parked.tp
        self._retrying.pop(tp, None)
        if tp not in consumer.assignment():
            return  # revoked meanwhile: the next owner reads it from the committed offset
        self._parked[tp] = parked
        consumer.pause(tp)
        # Records after it may have been fetched already: read them again after the retry.
        consumer.seek(tp, parked.offset)

    def wake_due(self, consumer: Any, now: float | None = None) -> None:
        """Resume the partitions whose message is due; it will be read (and retried) next."""
        if not self._parked:
            return
        now = time.monotonic() if now is None else now
        due = [p for p in self._parked.values() if p.due <= now]
        for parked in due:
            del self._parked[parked.tp]
            self._retrying[parked.tp] = parked.offset
        if due:
            consumer.resume(*[p.tp for p in due])

    def without_parked(self, records: list[Any]) -> list[Any]:
        """*records* less those of parked partitions (fetched before the pause took effect)."""
        if not self._parked:
            return records
        return [r for r in records
                if TopicPartition(r.topic, r.partition) not in self._parked]

    def retries_in(self, records: Iterable[Any]) -> frozenset[tuple[str, int, int]]:
        """The (topic, partition, offset) of *records* that are retries of parked messages."""
        if not self._retrying:
            return frozenset()
        return frozenset(
            (r.topic, r.partition, r.offset)
            for r in records
            if self._retrying.get(TopicPartition(r.topic, r.partition)) == r.offset
        )

    def handled(self, retries: Iterable[tuple[str, int, int]]) -> None:
        """The batch that carried these retries finished: they are no longer pending."""
        for topic, partition, offset in retries:
            tp = TopicPartition(topic, partition)
            if self._retrying.get(tp) == offset:
                del self._retrying[tp]

    def sync(self, consumer: Any) -> None:
        """Agree with the consumer after a poll (and a rebalance it may have run).

        A parked partition no longer assigned, or no longer paused (assigned anew: it is
        read from the committed offset, the message with it), is forgotten; its attempts
        are counted in the database, not here. A partition paused that the lot does not
        hold any more is resumed: nothing else pauses partitions.
        """
        paused = consumer.paused()
        if not (self._parked or self._retrying or paused):
            return
        assigned = consumer.assignment()
        for tp in [tp for tp in self._parked if tp not in assigned or tp not in paused]:
            del self._parked[tp]
        for tp in [tp for tp in self._retrying if tp not in assigned]:
            del self._retrying[tp]
        stray = [tp for tp in paused if tp not in self._parked]
        if stray:
            consumer.resume(*stray)

    def clear(self) -> None:
        """Forget everything (the client was replaced: its pauses went with it; the parked
        messages are read again from the committed offsets, their attempts counted in the
        database)."""
        self._parked.clear()
        self._retrying.clear()

    def partitions(self) -> set[TopicPartition]:
        """The partitions paused by a parked message."""
        return set(self._parked)

    def next_due(self) -> float | None:
        """When the earliest parked message is due (``time.monotonic()``), if any."""
        return min((p.due for p in self._parked.values()), default=None)
