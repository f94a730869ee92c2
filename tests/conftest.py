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


# The longest tests go first. The suite runs on a few workers, each given its next test as
# it finishes one (`make test`: --maxschedchunk 1), and a test of minutes that starts last
# ends the run minutes after the others; started first, it runs beside everything else.
LONGEST_FIRST = (
    "tests/faults/test_faults.py",
    "tests/e2e/test_bench_suite.py",
    "tests/faults/test_faults_cluster.py",
    "tests/faults/properties/test_transition_properties.py",
    "tests/e2e/test_relay_failures.py",
    "tests/e2e/test_relay_crashes.py",
    "tests/integration/test_services_cluster.py",
    "tests/integration/test_kafka_cluster.py",
    "tests/e2e/test_agents_crash.py",
    "tests/e2e/test_pg_failover.py",
    "tests/e2e/test_consumer_keyed.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
