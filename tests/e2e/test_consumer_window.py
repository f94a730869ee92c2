"""The dedup window is checked against the broker's real retention.ms, and a consumer whose
topic does not exist yet waits for it (the relay creates it) instead of exiting."""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from consumers import Consumer, ConsumerSettings
from consumers.window import verify_window
from outbox.errors import ConfigurationError
from outbox.testing.processes import free_port
from tests.e2e.conftest import wait_until
from tests.e2e.consumer_support import InProcess, settings

DAY = 86_400.0


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture
def topics(kafka_bootstrap: str) -> Iterator[Callable[[str, float | None], None]]:
    """``create(name, retention_s)``: a topic with that retention.ms, deleted after the test."""
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="window-tests")
    created: list[str] = []

    def create(name: str, retention_s: float | None) -> None:
        config = {} if retention_s is None else {"retention.ms": str(int(retention_s * 1000))}
        admin.create_topics([NewTopic(name, 1, 1, topic_configs=config)])
        created.append(name)

    try:
        yield create
    finally:
        if created:
            admin.delete_topics(created)
        admin.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def window_settings(bootstrap: str, **overrides: float) -> ConsumerSettings:
    return ConsumerSettings(kafka_bootstrap=bootstrap, **overrides)  # type: ignore[arg-type]


class TestRealRetention:
    def test_a_stated_retention_understating_the_topics_is_refused_naming_both(
        self, kafka_bootstrap: str, topics: Callable[[str, float | None], None]
    ) -> None:
        topic = unique("win-30d")
        topics(topic, 30 * DAY)
        stated = window_settings(kafka_bootstrap, topic_retention_seconds=3600,
                                 dedup_retention_seconds=2 * DAY)
        with pytest.raises(ConfigurationError) as caught:
            verify_window(stated, [topic])
        message = str(caught.value)
        assert "keep messages 1 h" in message
        assert f"topic {topic!r} keeps messages 30 days" in message

    def test_the_brokers_retention_is_what_the_window_is_checked_against(
        self, kafka_bootstrap: str, topics: Callable[[str, float | None], None]
    ) -> None:
        topic = unique("win-31d")
        topics(topic, 31 * DAY)
        with pytest.raises(ConfigurationError, match=r"retention \(31 days\) plus"):
            verify_window(window_settings(kafka_bootstrap), [topic])  # default window: 8 days
        assert verify_window(window_settings(kafka_bootstrap, dedup_retention_seconds=32 * DAY),
                             [topic])

    def test_a_stated_retention_covering_the_topics_is_accepted(
        self, kafka_bootstrap: str, topics: Callable[[str, float | None], None]
    ) -> None:
        topic = unique("win-1d")
        topics(topic, DAY)
        stated = window_settings(kafka_bootstrap, topic_retention_seconds=2 * DAY,
                                 dedup_retention_seconds=3 * DAY)
        assert verify_window(stated, [topic]) is True


class TestMissingTopic:
    def test_a_missing_topic_is_waited_for_with_one_log_line_then_checked(
        self, kafka_bootstrap: str, topics: Callable[[str, float | None], None],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        topic = unique("win-later")
        outcome: list[bool | BaseException] = []

        def check() -> None:
            try:
                outcome.append(verify_window(window_settings(kafka_bootstrap), [topic],
                                             threading.Event(), interval_s=0.2))
            except BaseException as exc:  # surfaced by the assertions below
                outcome.append(exc)

        caplog.set_level(logging.INFO, logger="consumers.window")
        waiter = threading.Thread(target=check, daemon=True)
        waiter.start()
        wait_until(lambda: any("waiting for topic" in r.getMessage() for r in caplog.records),
                   60, "the waiting line")
        assert waiter.is_alive()
        assert not outcome
        topics(topic, 30 * DAY)  # the relay creates it; its retention is then checked
        waiter.join(timeout=60)
        assert len(outcome) == 1
        assert isinstance(outcome[0], ConfigurationError), outcome
        assert "retention (30 days)" in str(outcome[0])
        waiting = [r.getMessage() for r in caplog.records if "waiting for topic" in r.getMessage()]
        assert waiting == [
            f"waiting for topic {topic} to be created (the relay creates a topic when it first "
            "publishes to it); checking every 0.2 s"
        ]

    def test_stopping_while_waiting_returns_without_checking(self, kafka_bootstrap: str) -> None:
        stop = threading.Event()
        outcome: list[bool] = []
        waiter = threading.Thread(
            target=lambda: outcome.append(verify_window(
                window_settings(kafka_bootstrap), [unique("win-never")], stop, interval_s=0.2)),
            daemon=True,
        )
        waiter.start()
        stop.set()
        waiter.join(timeout=60)
        assert outcome == [False]

    def test_a_consumer_whose_topic_is_missing_waits_then_starts_once_it_exists(
        self, database_url: str, kafka_bootstrap: str,
        topics: Callable[[str, float | None], None], caplog: pytest.LogCaptureFixture,
    ) -> None:
        topic = unique("win-consumer")
        port = free_port()
        app = Consumer(f"g-{topic}",
                       settings=settings(database_url, kafka_bootstrap, http_port=port))
        app.register(topic, lambda ctx, item: None)
        caplog.set_level(logging.INFO, logger="consumers.window")
        with InProcess(app) as running:
            wait_until(lambda: any("waiting for topic" in r.getMessage()
                                   for r in caplog.records), 60, "the waiting line")
            assert running.thread.is_alive()
            assert not running.runner.ready()
            # A probe sees a live consumer that is not ready (not one to restart in a loop).
            assert _status(port, "/healthz") == 200
            assert _status(port, "/readyz") == 503
            topics(topic, DAY)
            wait_until(running.runner.ready, 90, "the consumer to start once its topic exists")
        assert running.error is None
