"""Choosing the Kafka client: one setting, a clear error for a wrong or missing one."""

from __future__ import annotations

import sys

import pytest

from outbox.errors import ConfigurationError
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
