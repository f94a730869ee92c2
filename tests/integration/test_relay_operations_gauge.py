"""The relay's gauge of ledger operations nobody has settled (for the needs-human alert)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox.db.dsn import sqlalchemy_url
from relay.daemon import Relay
from relay.roles import relay_grants
from relay.settings import RelaySettings

GAUGE = "outboxkit_relay_unsettled_operations"


def add_operations(engine: Engine, *statuses: str) -> None:
    with engine.begin() as conn:
        for status in statuses:
            conn.execute(
                text("INSERT INTO outboxkit.operations (id, idempotency_key, system, operation,"
                     " request_digest, status) VALUES (gen_random_uuid(), :k, 's', 'o', 'd', :s)"),
                {"k": uuid.uuid4().hex, "s": status},
            )


def relay_for(database_url: str) -> Relay:
    return Relay(RelaySettings(database_url=sqlalchemy_url(database_url),  # type: ignore[arg-type]
                               kafka_bootstrap="127.0.0.1:9"))  # never contacted here


def sample(relay: Relay, status: str) -> float | None:
    return relay.metrics.registry.get_sample_value(GAUGE, {"status": status})


def test_counts_unknown_and_needs_human_operations(engine: Engine, database_url: str) -> None:
    add_operations(engine, "unknown", "needs-human", "needs-human", "pending", "confirmed")
    relay = relay_for(database_url)
    try:
        relay._refresh_metrics()
        assert sample(relay, "unknown") == 1
        assert sample(relay, "needs-human") == 2
    finally:
        relay.pool.close()


@pytest.fixture
def least_privileged_url(database_url: str) -> Iterator[str]:
    role = f"relay_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'relay-pw'")  # type: ignore[arg-type]
        conn.execute(relay_grants("outboxkit", role))  # type: ignore[arg-type]
    yield f"postgresql://{role}:relay-pw@{database_url.split('@', 1)[1]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
        conn.execute(f"DROP ROLE {role}")  # type: ignore[arg-type]


def test_a_role_that_cannot_read_the_ledger_keeps_the_other_gauges_and_says_why_once(
    engine: Engine, database_url: str, least_privileged_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    add_operations(engine, "needs-human")
    relay = relay_for(least_privileged_url)
    try:
        with caplog.at_level(logging.WARNING, logger="relay.daemon"):
            relay._refresh_metrics()
            relay._refresh_metrics()
        assert sample(relay, "needs-human") is None  # absent, never a misleading 0
        assert relay.metrics.registry.get_sample_value("outboxkit_relay_failed_messages") == 0
        warnings = [r.getMessage() for r in caplog.records if "operations" in r.getMessage()]
        assert len(warnings) == 1
        assert "GRANT SELECT (status) ON outboxkit.operations" in warnings[0]

        # The grant it names is enough, and reads only the status column.
        role = least_privileged_url.split("//", 1)[1].split(":", 1)[0]
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"GRANT SELECT (status) ON outboxkit.operations TO {role}")  # type: ignore[arg-type]
        relay._operations_readable = True  # what a restart does
        relay._refresh_metrics()
        assert sample(relay, "needs-human") == 1
    finally:
        relay.pool.close()
