"""A topic the relay has just created takes its first batch without the broker refusing it."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from relay.claims import OutboxRow
from relay.publisher import Publisher
from relay.settings import RelaySettings


@pytest.fixture
def publisher(kafka_bootstrap: str) -> Iterator[Publisher]:
    created = Publisher(RelaySettings(database_url="postgresql://unused@127.0.0.1:9/unused",
                                      kafka_bootstrap=kafka_bootstrap, topic_partitions=6))
    try:
        yield created
    finally:
        created.close()


def rows(topic: str, count: int) -> list[OutboxRow]:
    now = datetime.now(UTC)
    return [OutboxRow(i, uuid.uuid4(), topic, f"key-{i}".encode(), "t", b"{}", {}, now, 0, 0)
            for i in range(count)]


def test_the_first_batch_to_a_topic_it_created_meets_ready_leaders(
    publisher: Publisher, kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kafka")
    topics = [f"fresh-{uuid.uuid4().hex[:8]}" for _ in range(5)]
    try:
        for topic in topics:
            assert publisher.missing_topics({topic}) == {}  # created
            published, failed = publisher.send(rows(topic, 60))  # keys on all 6 partitions
            assert failed == []
            assert {p.partition for p in published} == set(range(6))
    finally:
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.delete_topics(topics)
        finally:
            admin.close()
    refused = [r.getMessage() for r in caplog.records if "NotLeaderForPartition" in r.getMessage()]
    assert refused == []


def test_the_topics_listed_at_start_up_answer_the_first_batch(
    publisher: Publisher, kafka_bootstrap: str
) -> None:
    # The relay lists the broker's topics on a thread while it claims its first batch: that
    # batch's check finds its topic known, without waiting for the admin client.
    topic = f"listed-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
        publisher.list_topics_ahead()
        assert publisher.missing_topics(set()) == {}  # waits for the listing
        admin.delete_topics([topic])
        # Known from the listing: not asked again (a deleted topic would be created anew).
        assert topic in publisher._known_topics
        assert publisher.missing_topics({topic}) == {}
    finally:
        with contextlib.suppress(Exception):
            admin.delete_topics([topic])
        admin.close()
