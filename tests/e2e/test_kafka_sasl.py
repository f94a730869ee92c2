"""The relay and a consumer against a broker that requires SASL/PLAIN: the right password
publishes and consumes (dead letters too), a wrong one is reported clearly and loses nothing.

The shared test broker has no SASL listener, so this module starts a second, small KRaft
broker from the same jars with two listeners: SASL_PLAINTEXT for the relay, and PLAINTEXT
for the test's own checks (and the broker's readiness probe).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from sqlalchemy import Engine

from outbox.messages.envelope import Envelope
from outbox.testing import kafka
from outbox.testing.processes import free_port
from outbox.testing.tools import java_executable
from tests.e2e.conftest import RelayProcesses, count_status, emit_batch, read_topic, wait_until
from tests.e2e.consumer_support import (
    ConsumerProcesses,
    create_effects,
    effects,
    produce,
    scrape,
)

# Under pytest-xdist each worker that runs a test of this module starts its own SASL broker
# (a module fixture). Grouping them on one worker (xdist_group + --dist loadgroup) silently
# does nothing with pytest 9.2 (pytest-xdist issue 1386), so the suite runs --dist load.
pytestmark = pytest.mark.usefixtures("kafka_client")

USER, PASSWORD = "relay", "relay-Secret-9"

def sasl_listener(port: int, sasl_port: int, controller_port: int) -> dict[str, str]:
    """The broker's server.properties entries for a second listener, SASL/PLAIN."""
    return {
        "listeners": f"PLAINTEXT://127.0.0.1:{port},SASL_PLAINTEXT://127.0.0.1:{sasl_port},"
                     f"CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},"
                                f"SASL_PLAINTEXT://127.0.0.1:{sasl_port}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,"
                                          "SASL_PLAINTEXT:SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": "PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config":
            "org.apache.kafka.common.security.plain.PlainLoginModule required"
            f' user_{USER}="{PASSWORD}";',
    }


@dataclass(frozen=True)
class SaslBroker:
    plaintext: str  # for the test's checks
    sasl: str  # what the relay is given


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaslBroker]:
    java_executable()  # no Java: a clear ServiceError, never a silent skip
    home = tmp_path_factory.mktemp("kafka-sasl")
    port, sasl_port, controller_port = free_port(), free_port(), free_port()
    broker = kafka.start(home, port, controller_port, ready_timeout_s=120,
                         settings=sasl_listener(port, sasl_port, controller_port))
    try:
        yield SaslBroker(broker.bootstrap, f"127.0.0.1:{sasl_port}")
    finally:
        kafka.stop(home)


def sasl_settings(password: str) -> dict[str, str]:
    return {
        "kafka_security_protocol": "SASL_PLAINTEXT",
        "kafka_sasl_mechanism": "PLAIN",
        "kafka_sasl_username": USER,
        "kafka_sasl_password": password,
    }


def ready(http_port: int) -> float | None:
    try:
        return scrape(http_port, "outboxkit_relay_ready")
    except OSError:  # not listening yet
        return None


def messages(topic: str, n: int) -> list[Envelope]:
    return [Envelope(topic=topic, type="t", key=f"k{i % 3}", payload={"i": i}) for i in range(n)]


def test_the_relay_publishes_through_a_sasl_listener(
    engine: Engine, relays: RelayProcesses, sasl_broker: SaslBroker
) -> None:
    topic = f"sasl-{uuid.uuid4().hex[:8]}"
    sent = messages(topic, 20)
    emit_batch(engine, sent)
    relays.kafka_bootstrap = sasl_broker.sasl  # the relay knows only the SASL listener
    relays.start(**sasl_settings(PASSWORD))
    wait_until(lambda: count_status(engine, "published") == 20, 90, "20 published rows")
    records = read_topic(sasl_broker.plaintext, topic)
    assert sorted(dict(r.headers)["message-id"].decode() for r in records) == sorted(
        str(e.message_id) for e in sent
    )


def test_a_wrong_password_is_reported_and_loses_nothing(
    engine: Engine, relays: RelayProcesses, sasl_broker: SaslBroker
) -> None:
    topic = f"sasl-{uuid.uuid4().hex[:8]}"
    sent = messages(topic, 10)
    emit_batch(engine, sent)
    relays.kafka_bootstrap = sasl_broker.sasl
    http_port = free_port()
    wrong = relays.start(relay_id="wrong-password", http_port=http_port,
                         **sasl_settings("not-the-password"))
    log = relays.log_dir / "wrong-password.log"
    wait_until(lambda: "Authentication failed" in log.read_text(errors="replace"), 60,
               "the relay to log the refused authentication")
    wait_until(lambda: ready(http_port) == 0.0, 60, "the relay to report itself not ready")
    time.sleep(2)  # it keeps retrying meanwhile, and still publishes nothing
    assert count_status(engine, "pending") == 10
    assert count_status(engine, "failed") == 0
    assert wrong.poll() is None, "a refused password is retried, like any broker outage"
    assert ready(http_port) == 0.0
    text = log.read_text(errors="replace")
    assert "not-the-password" not in text
    relays.kill(wrong)

    # Fixing the password is enough: every message arrives, once.
    relays.start(**sasl_settings(PASSWORD))
    wait_until(lambda: count_status(engine, "published") == 10, 90, "10 published rows")
    records = read_topic(sasl_broker.plaintext, topic)
    assert sorted(dict(r.headers)["message-id"].decode() for r in records) == sorted(
        str(e.message_id) for e in sent
    )


def test_a_consumer_reads_and_dead_letters_through_a_sasl_listener(
    engine: Engine, database_url: str, sasl_broker: SaslBroker, tmp_path: Path
) -> None:
    topic = f"sasl-items-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=sasl_broker.plaintext)
    try:
        admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        admin.close()
    create_effects(engine)
    ids = produce(sasl_broker.plaintext, topic,
                  [{"n": 1}, {"n": 2, "fail": "dead-letter"}, {"n": 3}])
    # Over SASL: the group's reads and commits, the dedup window's retention lookup (admin),
    # and the dead letter's topic creation and send.
    consumers = ConsumerProcesses(database_url, sasl_broker.sasl, topic, tmp_path)
    env = {f"OUTBOXKIT_CONSUMER_{k.upper()}": v for k, v in sasl_settings(PASSWORD).items()}
    try:
        consumers.start(**env)
        # The refused message's effect rolls back with its savepoint: two effects stay.
        wait_until(lambda: set(effects(engine)) == {ids[0], ids[2]}, 90, "2 handled messages")
        wait_until(lambda: len(read_topic(sasl_broker.plaintext, topic + ".dlq")) == 1, 60,
                   "the dead letter")
    finally:
        consumers.stop_all()
    dead = read_topic(sasl_broker.plaintext, topic + ".dlq")
    assert dict(dead[0].headers)["message-id"].decode() == ids[1]
    assert PASSWORD not in consumers.logs()
