"""A dead letter is replayed once, whoever asks: two replays at the same moment send it once
(a compare-and-set on its status), and a replay that could not be sent leaves it
dead-lettered with its dedup mark back, as before."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from kafka import KafkaConsumer
from sqlalchemy import Engine, text

from consumers.deadletter import KafkaSender
from consumers.errors import NotDeadLettered
from consumers.failures import get_failure
from consumers.replay import republish
from consumers.settings import ConsumerSettings
from dedup.inbox import Mark, is_marked, mark
from outbox.kafka import KafkaClientError
from tests.integration.test_cli_dlq import dead_letter


def _sent(bootstrap: str, topic: str) -> int:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=3_000)
    try:
        return sum(1 for _ in consumer)
    finally:
        consumer.close()


def test_two_replays_at_once_send_it_once(engine: Engine, kafka_bootstrap: str,
                                          kafka_topic: Callable[..., str]) -> None:
    topic = kafka_topic()
    with engine.begin() as conn:
        failure_id, _ = dead_letter(conn, topic, 5, "widget")
    outcomes: list[Any] = []
    start = threading.Barrier(2)

    def replay() -> None:
        sender = KafkaSender(ConsumerSettings(kafka_bootstrap=kafka_bootstrap).kafka(),
                             client_id="replay-test")
        try:
            start.wait()
            outcomes.append(republish(engine, sender, failure_id))
        except NotDeadLettered as exc:
            outcomes.append(exc)
        finally:
            sender.close()

    threads = [threading.Thread(target=replay) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(type(o).__name__ for o in outcomes) == ["NotDeadLettered", "Sent"]
    assert _sent(kafka_bootstrap, topic) == 1
    with engine.connect() as conn:
        failure = get_failure(conn, failure_id)
    assert failure is not None
    assert failure.status == "replayed"


class Refusing:
    """A sender whose broker refuses (what KafkaSender raises when Kafka says no)."""

    def send(self, *args: Any, **kwargs: Any) -> Any:
        raise KafkaClientError("broker down")


def test_a_replay_not_sent_leaves_the_dead_letter_as_it_was(engine: Engine) -> None:
    with engine.begin() as conn:
        failure_id, message_id = dead_letter(conn, "order.submit", 9, "widget")
        mark(conn, "orders", Mark(message_id, "order.submit", 0, 9))
    with pytest.raises(KafkaClientError):
        republish(engine, Refusing(), failure_id)  # type: ignore[arg-type]
    with engine.connect() as conn:
        failure = get_failure(conn, failure_id)
        assert failure is not None
        assert (failure.status, failure.replayed_at) == ("dead-lettered", None)
        assert is_marked(conn, "orders", message_id)


def test_a_replay_not_sent_puts_back_no_mark_that_was_not_there(engine: Engine) -> None:
    """A message dead-lettered without a mark (none was written): a failed replay must not
    invent one, or its real redeliveries would be dropped as duplicates."""
    with engine.begin() as conn:
        failure_id, message_id = dead_letter(conn, "order.submit", 10, "widget")
    with pytest.raises(KafkaClientError):
        republish(engine, Refusing(), failure_id)  # type: ignore[arg-type]
    with engine.connect() as conn:
        assert not is_marked(conn, "orders", message_id)
        failure = get_failure(conn, failure_id)
    assert failure is not None
    assert failure.status == "dead-lettered"


def test_a_failed_replay_again_leaves_the_earlier_replay_as_it_was(engine: Engine) -> None:
    """Replayed by ann (and handled since); bob's --again is refused by Kafka: the failure
    must still say replayed by ann, not dead-lettered (which would invite a third copy)."""
    with engine.begin() as conn:
        failure_id, message_id = dead_letter(conn, "order.submit", 13, "widget")
        conn.execute(text("UPDATE outboxkit.consumer_failures SET status = 'replayed', "
                          "replayed_at = now(), replayed_by = 'ann' WHERE id = :i"),
                     {"i": failure_id})
        mark(conn, "orders", Mark(message_id, "order.submit", 0, 13))  # its handling's mark
    with pytest.raises(KafkaClientError):
        republish(engine, Refusing(), failure_id, again=True, actor="bob")  # type: ignore[arg-type]
    with engine.connect() as conn:
        failure = get_failure(conn, failure_id)
        assert is_marked(conn, "orders", message_id)
    assert failure is not None
    assert (failure.status, failure.replayed_by) == ("replayed", "ann")
