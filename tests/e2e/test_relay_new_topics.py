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

from outbox.kafka import CLIENT_NAMES, Delivery, KafkaClientError, backend
from outbox.kafka.api import Connection
from outbox.testing.kafka import start as start_broker
from outbox.testing.kafka import stop as stop_broker
from outbox.testing.processes import free_port
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
def existing_topic(publisher: Publisher, bootstrap: str,
                   prefix: str) -> Iterator[tuple[KafkaAdminClient, str]]:
    """A new topic, listed by the broker, then the publisher's admin client made ahead (as at
    the relay's start); the topic is deleted at the end."""
    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
        until_listed(admin, topic, listed=True)
        publisher.admin_ahead()
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


def test_a_batch_asks_about_its_own_topics_only_and_once(
    publisher: Publisher, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    # The cluster's whole list is never read: a cluster of thousands of topics made every
    # start and every new topic wait for it (110 ms at 2,043 topics).
    with existing_topic(publisher, kafka_bootstrap, "asked") as (admin, topic):
        publisher._made()
        monkeypatch.setattr(publisher._admin_client(), "list_topics", lambda: pytest.fail(
            "the publisher listed every topic of the cluster"))
        with caplog.at_level(logging.INFO, logger="relay.publisher"):
            assert publisher.missing_topics({topic}) == {}
        assert not [r for r in caplog.records if getattr(r, "event", None) == "relay.topic_created"]
        admin.delete_topics([topic])
        # Known from the answer: not asked again (a deleted topic would be created anew).
        assert topic in publisher._known_topics
        assert publisher.missing_topics({topic}) == {}


def test_a_known_topic_deleted_since_is_created_again_after_a_transient_failure(
    publisher: Publisher, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Known, then deleted: librdkafka reports its records only as timed out
    # (after topic.metadata.propagation.max.ms, 30 s), a transient failure. That failure is
    # played here; what is tested is what the publisher makes of it: it asks the broker
    # again for the next batch of that topic, and creates it, instead of failing until a
    # restart (review finding L2).
    with existing_topic(publisher, kafka_bootstrap, "gone") as (admin, topic):
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


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_asking_about_a_topic_never_creates_it(
    client: str, auto_creating_broker: str
) -> None:
    # Kafka's default auto.create.topics.enable is true: a metadata request naming a topic
    # then creates it, with the broker's defaults, unless the request says not to.
    # librdkafka's admin client (a producer's) said so by default: with
    # OUTBOXKIT_RELAY_CREATE_TOPICS=false the relay would have made the topic anyway.
    admin = backend(client, Connection(auto_creating_broker)).admin("ask-probe")
    try:
        missing = f"asked-{uuid.uuid4().hex[:8]}"
        assert admin.existing_topics({missing}) == set()
        time.sleep(1)  # a creation the question set off would be listed by now
        assert missing not in admin.list_topics()
    finally:
        admin.close()


@pytest.fixture(scope="module")
def auto_creating_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A broker of its own that creates a topic a metadata request names (Kafka's default;
    the test services' broker does not)."""
    home = tmp_path_factory.mktemp("auto-create-broker")
    broker = start_broker(home, free_port(), free_port(),
                          settings={"auto.create.topics.enable": "true"})
    try:
        yield f"127.0.0.1:{broker.port}"
    finally:
        stop_broker(home)
