"""kafka-python finishes a group join that one poll started and the next poll finds done.

The sequence behind a consumer that silently stopped consuming
(outbox/kafka/kafka_python_fixes.py): the leader's metadata changed since its last assignment, so
it rejoins; the poll that started the join returns before the join completes; inside the join, the
leader computes the new assignment, and from then on kafka-python 3.0 no longer thinks a rejoin is
needed, so no later poll applies the assignment. Real broker, one member (it is the leader).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.coordinator.consumer import ConsumerCoordinator

from outbox.kafka import kafka_python_fixes as kafka_fix


class Assignments(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.seen: list[set[TopicPartition]] = []

    def on_partitions_revoked(self, revoked: Any) -> None:
        pass

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.seen.append(set(assigned))


@pytest.fixture
def member(
    kafka_bootstrap: str, kafka_topic: Callable[..., str]
) -> Iterator[tuple[KafkaConsumer, Assignments, set[TopicPartition]]]:
    topic = kafka_topic(partitions=2)
    listener = Assignments()
    consumer = KafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=f"rejoin-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    consumer.subscribe([topic], listener=listener)
    everything = {TopicPartition(topic, 0), TopicPartition(topic, 1)}
    try:
        _poll_until(consumer, lambda: consumer.assignment() == everything, 30)
        yield consumer, listener, everything
    finally:
        consumer.close(autocommit=False)


def _poll_until(consumer: KafkaConsumer, done: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        consumer.poll(timeout_ms=100)
        if done():
            return True
    return False


def _start_a_join_that_outlives_its_poll(consumer: KafkaConsumer) -> Any:
    coordinator = consumer._coordinator
    coordinator._assignment_snapshot = {}  # what a metadata change looks like to the leader
    consumer.poll(timeout_ms=0)  # prepares the join and starts it, then returns at once
    assert coordinator.rejoining, "the poll did not start a join"
    deadline = time.monotonic() + 15
    while not coordinator._join_task.is_done:  # the IO thread runs JoinGroup and SyncGroup
        assert time.monotonic() < deadline, "the join did not complete"
        time.sleep(0.05)
    return coordinator


def test_the_next_poll_applies_the_assignment_of_a_finished_join(
    member: tuple[KafkaConsumer, Assignments, set[TopicPartition]],
) -> None:
    consumer, listener, everything = member
    kafka_fix.install()
    before = len(listener.seen)
    _start_a_join_that_outlives_its_poll(consumer)
    assert _poll_until(consumer, lambda: len(listener.seen) > before, 10), listener.seen
    assert listener.seen[-1] == everything
    assert consumer.assignment() == everything


def test_without_the_fix_kafka_python_never_applies_it(
    member: tuple[KafkaConsumer, Assignments, set[TopicPartition]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the fix is for; if a kafka-python release stops doing this, the fix can go.
    consumer, listener, _ = member
    kafka_fix.install()
    original = ConsumerCoordinator.__dict__["need_rejoin"].__wrapped__
    monkeypatch.setattr(ConsumerCoordinator, "need_rejoin", original)
    before = len(listener.seen)
    coordinator = _start_a_join_that_outlives_its_poll(consumer)
    assert not _poll_until(consumer, lambda: len(listener.seen) > before, 3)
    assert coordinator.rejoining, "the join was applied after all"
