"""Choosing the Kafka client: one setting, a clear error for a wrong or missing one, and
the daemons' start-up lines saying which client (and version) they run."""

from __future__ import annotations

import logging
import sys

import confluent_kafka
import kafka
import pytest

from consumers import Consumer
from consumers.runner import Runner
from consumers.settings import ConsumerSettings
from outbox.errors import ConfigurationError
from relay.daemon import Relay
from relay.publisher import Publisher
from relay.settings import RelaySettings


def test_kafka_python_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOXKIT_KAFKA_CLIENT", raising=False)
    monkeypatch.delenv("OUTBOXKIT_RELAY_KAFKA_CLIENT", raising=False)
    assert RelaySettings(kafka_bootstrap="127.0.0.1:9092").kafka().name == "kafka-python"


def test_the_shared_variable_chooses_and_the_daemons_own_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOXKIT_KAFKA_CLIENT", "confluent")
    assert RelaySettings(kafka_bootstrap="127.0.0.1:9092").kafka().name == "confluent"
    monkeypatch.setenv("OUTBOXKIT_RELAY_KAFKA_CLIENT", "kafka-python")
    assert RelaySettings(kafka_bootstrap="127.0.0.1:9092").kafka().name == "kafka-python"


def test_an_unknown_client_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOXKIT_RELAY_KAFKA_CLIENT", raising=False)
    monkeypatch.setenv("OUTBOXKIT_KAFKA_CLIENT", "librdkafka")
    with pytest.raises(ConfigurationError, match=r"'librdkafka'.*kafka-python"):
        RelaySettings(kafka_bootstrap="127.0.0.1:9092").kafka()


def test_confluent_without_its_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # import fails as if absent
    for name in [m for m in sys.modules if m.startswith("outbox.kafka.confluent")]:
        monkeypatch.delitem(sys.modules, name)
    settings = RelaySettings(kafka_bootstrap="127.0.0.1:9092", kafka_client="confluent")
    with pytest.raises(ConfigurationError, match=r"pip install 'outboxkit\[confluent\]'"):
        settings.kafka()


class _Started(Exception):
    """Raised where the daemon would open its HTTP port: the start-up line is logged by then."""


def _stop_at_http(*_args: object) -> None:
    raise _Started


EXPECTED = {
    "kafka-python": f"kafka-python {kafka.__version__}",
    "confluent": f"confluent-kafka {confluent_kafka.__version__} "
                 f"(librdkafka {confluent_kafka.libversion()[0]})",
}


@pytest.mark.parametrize("client", sorted(EXPECTED))
def test_the_relays_start_up_line_names_the_kafka_client_and_its_version(
    client: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("OUTBOXKIT_RELAY_KAFKA_CLIENT", raising=False)
    monkeypatch.setenv("OUTBOXKIT_KAFKA_CLIENT", client)
    relay = Relay(RelaySettings(database_url="postgresql://app@127.0.0.1:9/app",
                                kafka_bootstrap="127.0.0.1:9"))
    monkeypatch.setattr(relay.lifecycle, "serve_http", _stop_at_http)
    with caplog.at_level(logging.INFO, logger="relay.daemon"), pytest.raises(_Started):
        relay.run()
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "relay.start"]
    assert f"with {EXPECTED[client]}," in line.getMessage()
    assert getattr(line, "kafka_client", None) == EXPECTED[client]


@pytest.mark.parametrize("client", sorted(EXPECTED))
def test_the_consumers_start_up_line_names_the_kafka_client_and_its_version(
    client: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app = Consumer("start-up", settings=ConsumerSettings(
        database_url="postgresql://app@127.0.0.1:9/app", kafka_bootstrap="127.0.0.1:9",
        kafka_client=client))
    app.register("orders", lambda ctx, payload: None)
    runner = Runner(app)
    monkeypatch.setattr(runner.lifecycle, "serve_http", _stop_at_http)
    with caplog.at_level(logging.INFO, logger="consumers.runner"), pytest.raises(_Started):
        runner.run()
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "consumer.start"]
    assert f"with {EXPECTED[client]}," in line.getMessage()
    assert getattr(line, "kafka_client", None) == EXPECTED[client]


@pytest.mark.parametrize(("client", "expected"), [("confluent", 0), ("kafka-python", 5)])
def test_the_relays_linger_is_its_clients_best_unless_set(client: str, expected: int) -> None:
    unset = RelaySettings(kafka_bootstrap="k:9092", kafka_client=client)
    assert unset.resolved_linger_ms() == expected
    chosen = RelaySettings(kafka_bootstrap="k:9092", kafka_client=client, linger_ms=20)
    assert chosen.resolved_linger_ms() == 20
    assert Publisher.options_for(chosen).linger_ms == 20
