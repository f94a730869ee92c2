"""A topic the relay has just created takes its first batch without the broker refusing it."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from outbox.kafka import Delivery, KafkaClientError
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


def until_listed(admin: KafkaAdminClient, topic: str, *, listed: bool) -> None:
    """Topic creation and deletion are asynchronous: wait until the broker lists it (or no
    longer does)."""
    deadline = time.monotonic() + 30
    while (topic in admin.list_topics()) != listed:
        assert time.monotonic() < deadline, f"{topic} listed: {not listed} after 30 s"
        time.sleep(0.1)


@contextlib.contextmanager
def listed_ahead(publisher: Publisher, bootstrap: str,
                 prefix: str) -> Iterator[tuple[KafkaAdminClient, str]]:
    """A new topic, listed by the broker, then the publisher's listing ahead started (as at
    the relay's start); the topic is deleted at the end."""
    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
        until_listed(admin, topic, listed=True)
        publisher.list_topics_ahead()
        yield admin, topic
    finally:
        with contextlib.suppress(Exception):
            admin.delete_topics([topic])
        admin.close()


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
    with listed_ahead(publisher, kafka_bootstrap, "listed") as (admin, topic):
        assert publisher.missing_topics(set()) == {}  # waits for the listing
        admin.delete_topics([topic])
        # Known from the listing: not asked again (a deleted topic would be created anew).
        assert topic in publisher._known_topics
        assert publisher.missing_topics({topic}) == {}


def test_a_listed_topic_deleted_since_is_created_again_after_a_transient_failure(
    publisher: Publisher, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Known from a listing, then deleted: librdkafka reports its records only as timed out
    # (after topic.metadata.propagation.max.ms, 30 s), a transient failure. That failure is
    # played here; what is tested is what the publisher makes of it: it asks the broker
    # again for the next batch of that topic, and creates it, instead of failing until a
    # restart (review finding L2).
    with listed_ahead(publisher, kafka_bootstrap, "gone") as (admin, topic):
        assert publisher.missing_topics({topic}) == {}
        admin.delete_topics([topic])
        until_listed(admin, topic, listed=False)
        timed_out = Delivery(error=KafkaClientError("KafkaTimeoutError: no answer"))
        with monkeypatch.context() as patched:
            patched.setattr(publisher.producer, "send",
                            lambda records, **_: [timed_out for _ in records])
            published, failed = publisher.send(rows(topic, 2))
        assert published == []
        assert [f.permanent for f in failed] == [False, False]
        assert publisher.missing_topics({topic}) == {}  # created again
        assert topic in admin.list_topics()
        published, failed = publisher.send(rows(topic, 3))
        assert failed == []
        assert len(published) == 3
