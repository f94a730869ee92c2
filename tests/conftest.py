"""Fixtures every test directory shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox.kafka import CLIENT_NAMES
from outbox.testing.toxiproxy import Server


@pytest.fixture(params=CLIENT_NAMES)
def kafka_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test once with each Kafka client, for the guarantees where the client is part
    of what is proved (crashes, outages, refusals, TLS/SASL). Everything the test starts reads
    ``OUTBOXKIT_KAFKA_CLIENT``: relays and consumers in this process and the child processes,
    which inherit the environment. The client interface itself is proved for both in
    tests/integration/test_kafka_clients.py, so the other Kafka tests run with the default."""
    monkeypatch.setenv("OUTBOXKIT_KAFKA_CLIENT", request.param)
    return str(request.param)


@pytest.fixture(scope="session")
def toxiproxy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A Toxiproxy server (outbox.testing.toxiproxy) for this test process, stopped by its
    pid at the end; each test makes and deletes proxies of its own on it."""
    server = Server(tmp_path_factory.mktemp("toxiproxy"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
