"""Fixtures every test directory shares."""

from __future__ import annotations

import pytest

from outbox.kafka import CLIENT_NAMES


@pytest.fixture(params=CLIENT_NAMES)
def kafka_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test once with each Kafka client, for the guarantees where the client is part
    of what is proved (crashes, outages, refusals, TLS/SASL). Everything the test starts reads
    ``OUTBOXKIT_KAFKA_CLIENT``: relays and consumers in this process and the child processes,
    which inherit the environment. The client interface itself is proved for both in
    tests/integration/test_kafka_clients.py, so the other Kafka tests run with the default."""
    monkeypatch.setenv("OUTBOXKIT_KAFKA_CLIENT", request.param)
    return str(request.param)
