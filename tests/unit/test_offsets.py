"""The offset tracker: asynchronous commits in the loop never lose or repeat an offset."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from consumers.offsets import OffsetTracker
from outbox.kafka import TopicPartition


@dataclass
class Record:
    topic: str
    partition: int
    offset: int


class RecordingConsumer:
    """Keeps each asynchronous commit's callback so the test decides when Kafka answers."""

    def __init__(self) -> None:
        self.sent: list[tuple[dict[Any, Any], Callable[[Any, Any], None]]] = []
        self.synced: list[dict[Any, Any]] = []

    def commit_async(self, offsets: dict[Any, Any], callback: Callable[[Any, Any], None]) -> None:
        self.sent.append((offsets, callback))

    def commit(self, offsets: dict[Any, Any]) -> None:
        self.synced.append(offsets)


TP = TopicPartition("t", 0)


def test_an_offset_in_flight_is_not_sent_twice_and_is_confirmed_by_the_answer() -> None:
    tracker, consumer = OffsetTracker(), RecordingConsumer()
    tracker.done([Record("t", 0, 9)])
    tracker.commit_async(consumer)
    tracker.commit_async(consumer)  # still in flight: nothing new to send
    assert [dict(o) for o, _ in consumer.sent] == [{TP: 10}]
    offsets, answer = consumer.sent[0]
    answer(offsets, None)  # Kafka accepted it
    assert tracker.committed == {TP: 10}
    assert tracker.uncommitted(None) == {}
    assert tracker.commit(consumer) is True
    assert consumer.synced == []  # nothing left for a synchronous commit


def test_a_failed_asynchronous_commit_is_sent_again() -> None:
    tracker, consumer = OffsetTracker(), RecordingConsumer()
    tracker.done([Record("t", 0, 4)])
    tracker.commit_async(consumer)
    offsets, answer = consumer.sent[0]
    answer(offsets, RuntimeError("coordinator moved"))
    assert tracker.committed == {}
    tracker.commit_async(consumer)
    assert len(consumer.sent) == 2
    assert consumer.sent[1][0][TP] == 5


def test_a_late_answer_for_an_older_offset_does_not_move_committed_back() -> None:
    tracker, consumer = OffsetTracker(), RecordingConsumer()
    tracker.done([Record("t", 0, 4)])
    tracker.commit_async(consumer)
    tracker.done([Record("t", 0, 7)])
    tracker.commit(consumer)  # e.g. a revocation commits 8 synchronously
    old, answer = consumer.sent[0]
    answer(old, None)
    assert tracker.committed == {TP: 8}


def test_forgotten_partitions_are_neither_pending_nor_committed() -> None:
    tracker, consumer = OffsetTracker(), RecordingConsumer()
    tracker.done([Record("t", 0, 1), Record("t", 1, 3)])
    tracker.forget([TP])
    tracker.commit_async(consumer)
    assert [set(o) for o, _ in consumer.sent] == [{TopicPartition("t", 1)}]


def test_work_finished_after_a_revocation_is_left_to_the_next_owner() -> None:
    # The handler thread may finish a batch after the rebalance listener gave the partition
    # away: its offset is not ours to commit any more, until the partition comes back.
    tracker, consumer = OffsetTracker(), RecordingConsumer()
    tracker.done([Record("t", 0, 1)])
    tracker.revoke([TP])
    tracker.done([Record("t", 0, 2), Record("t", 1, 5)])
    tracker.commit_async(consumer)
    assert [dict(o) for o, _ in consumer.sent] == [
        {TopicPartition("t", 1): 6}
    ]
    tracker.assign([TP])
    tracker.done([Record("t", 0, 3)])
    assert tracker.uncommitted([TP])[TP] == 4
