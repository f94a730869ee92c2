"""Outages the relay waits out: counted by source, and said in one warning line with the cause.

The relay runs in-process (a thread) so its metrics and log records can be read directly; the
database and the broker are the real ones. The database "restart" is this test's own database
refusing connections after its sessions were terminated, which is what a restart looks like
to a client; the shared server itself is never stopped.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from kafka import KafkaAdminClient
from kafka import errors as kafka_errors
from kafka.admin import NewTopic
from sqlalchemy import Engine

from outbox.db.dsn import sqlalchemy_url
from outbox.messages.envelope import Envelope
from relay import Relay, RelaySettings
from tests.e2e.conftest import count_status, emit_batch, wait_until

pytestmark = pytest.mark.timeout(150)

ERRORS = "outboxkit_relay_transient_errors_total"


class InProcessRelay:
    """A :class:`Relay` in a thread; ``stop()`` joins it."""

    def __init__(self, database_url: str, bootstrap: str, **settings: object) -> None:
        self.relay = Relay(
            RelaySettings(
                database_url=sqlalchemy_url(database_url),
                kafka_bootstrap=bootstrap,
                relay_id=f"relay-{uuid.uuid4().hex[:6]}",
                lane_lease_seconds=3,
                poll_interval_seconds=0.2,
                backoff_max_seconds=1,
                **settings,  # type: ignore[arg-type]
            )
        )
        self.thread = threading.Thread(target=self.relay.run, daemon=True)

    def errors(self, source: str) -> float | None:
        return self.relay.metrics.registry.get_sample_value(ERRORS, {"source": source})

    def __enter__(self) -> InProcessRelay:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.relay.stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the relay did not stop within 60 s"


StartRelay = Callable[..., InProcessRelay]


@pytest.fixture
def start_relay(database_url: str, kafka_bootstrap: str) -> StartRelay:
    """``start_relay(**settings)``: a relay on this test's database and the real broker."""
    return lambda **settings: InProcessRelay(database_url, kafka_bootstrap, **settings)


@pytest.fixture
def relay_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="relay")
    return caplog


def relay_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("relay")]


def not_ready_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in relay_records(caplog) if getattr(r, "event", None) == "relay.not_ready"]


@pytest.fixture
def refuse_connections(postgres_dsn: str, database_url: str) -> Iterator[Callable[[bool], None]]:
    """``refuse(True)``: this test's database ends its sessions and refuses new ones."""
    name = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]

    def refuse(on: bool) -> None:
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(not on).lower()}')
            if on:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                              " WHERE datname = %s AND pid <> pg_backend_pid()", (name,))

    try:
        yield refuse
    finally:
        refuse(False)


def test_a_relay_started_while_the_database_refuses_it_takes_its_lanes_once_it_answers(
    engine: Engine, start_relay: StartRelay, kafka_topic: Callable[..., str],
    refuse_connections: Callable[[bool], None],
) -> None:
    """The first lane heartbeat runs beside the producer's making; when it fails, the start-up
    backs off and beats again, as any transient failure."""
    topic = kafka_topic()
    emit_batch(engine, [Envelope(topic=topic, type="t", key="k", payload={"n": 1})])
    engine.dispose()  # its sessions are about to be terminated
    refuse_connections(True)
    with start_relay() as relay:
        wait_until(lambda: (relay.errors("postgres") or 0) >= 1, 30, "a postgres error counted")
        assert not relay.relay.ready()
        refuse_connections(False)
        wait_until(lambda: count_status(engine, "published") == 1, 60, "the message published")
        assert relay.relay.ready()
        assert relay.relay.lanes.owned()  # its lanes, taken after the database came back


def test_a_database_that_goes_away_counts_postgres_errors_and_warns_once_with_the_cause(
    engine: Engine, start_relay: StartRelay, kafka_topic: Callable[..., str],
    refuse_connections: Callable[[bool], None], relay_logs: pytest.LogCaptureFixture,
) -> None:
    topic = kafka_topic()
    with start_relay() as relay:
        assert relay.errors("postgres") == 0  # exported before the first error
        emit_batch(engine, [Envelope(topic=topic, type="t", key="k", payload={"n": 1})])
        wait_until(lambda: count_status(engine, "published") == 1, 60, "the first message")
        engine.dispose()  # its sessions are about to be terminated
        refuse_connections(True)
        wait_until(lambda: (relay.errors("postgres") or 0) >= 2, 30, "postgres errors counted")
        assert not relay.relay.ready()
        refuse_connections(False)
        wait_until(relay.relay.ready, 30, "the relay to be ready again")
        emit_batch(engine, [Envelope(topic=topic, type="t", key="k", payload={"n": 2})])
        wait_until(lambda: count_status(engine, "published") == 2, 60, "the second message")
        assert relay.errors("kafka") == 0

    warnings = not_ready_records(relay_logs)
    assert len(warnings) >= 1
    first = warnings[0]
    assert first.levelno == logging.WARNING
    assert "is not ready: " in first.getMessage()
    # The driver's own class names the cause (a terminated session, a refused connection).
    assert re.search(r"(AdminShutdown|OperationalError): ", first.getMessage()), first.getMessage()
    for record in relay_records(relay_logs):
        assert record.exc_info is None, f"a traceback for an outage: {record.getMessage()}"
        assert "\n" not in record.getMessage(), record.getMessage()
        assert "is not ready" not in record.getMessage() or record.levelno == logging.WARNING


@pytest.mark.usefixtures("kafka_client")
def test_a_batch_kafka_does_not_acknowledge_counts_as_one_kafka_error(
    engine: Engine, kafka_bootstrap: str, start_relay: StartRelay,
    kafka_topic: Callable[..., str], relay_logs: pytest.LogCaptureFixture,
) -> None:
    topic = kafka_topic()
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        with start_relay(delivery_timeout_ms=8000) as relay:
            assert relay.errors("kafka") == 0
            emit_batch(engine, [Envelope(topic=topic, type="t", key="k", payload={"n": 1})])
            wait_until(lambda: count_status(engine, "published") == 1, 60, "the first message")
            # The relay knows the topic; the broker then stops answering for it: the batch is
            # neither acknowledged nor refused until the producer's delivery timeout.
            admin.delete_topics([topic])
            time.sleep(1)
            emit_batch(engine, [Envelope(topic=topic, type="t", key="k", payload={"n": 2})])
            wait_until(
                lambda: any("not acknowledged" in r.getMessage()
                            for r in relay_records(relay_logs)),
                60, "the batch to fail",
            )
            # Counted when its acknowledgement was late, not once more when it failed.
            assert relay.errors("kafka") == 1
            assert not relay.relay.ready()
            recreate(admin, topic)
            wait_until(lambda: count_status(engine, "published") == 2, 90, "the second message")
            wait_until(relay.relay.ready, 30, "the relay to be ready again")
            assert relay.errors("postgres") == 0
    finally:
        admin.close()
    warnings = not_ready_records(relay_logs)
    assert warnings[0].levelno == logging.WARNING
    assert "Kafka has not acknowledged a batch for 5 s" in warnings[0].getMessage()


def recreate(admin: KafkaAdminClient, topic: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            admin.create_topics([NewTopic(topic, 1, 1)])
            return
        except kafka_errors.TopicAlreadyExistsError:  # its deletion is still under way
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
