"""The relay runs as a role that can read and mark outbox rows and nothing else."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from sqlalchemy import Engine

from outbox.messages.envelope import Envelope
from relay.roles import relay_grants
from tests.e2e.conftest import RelayProcesses, count_status, emit_batch, wait_until


@pytest.fixture
def relay_role(database_url: str) -> str:
    role = f"relay_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'relay-pw'")  # type: ignore[arg-type]
        conn.execute(relay_grants("outboxkit", role))  # type: ignore[arg-type]
    yield role  # type: ignore[misc]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
        conn.execute(f"DROP ROLE {role}")  # type: ignore[arg-type]


def role_url(database_url: str, role: str) -> str:
    host_and_db = database_url.split("@", 1)[1]
    return f"postgresql://{role}:relay-pw@{host_and_db}"


def test_the_relay_publishes_as_its_least_privileged_role(
    engine: Engine, database_url: str, relays: RelayProcesses, relay_role: str
) -> None:
    topic = f"priv-{uuid.uuid4().hex[:8]}"
    emit_batch(engine, [Envelope(topic=topic, type="t", key=f"k{i}", payload={"i": i})
                        for i in range(50)])
    relays.database_url = role_url(database_url, relay_role)
    relays.start(published_retention_seconds=0.5, retention_interval_seconds=1)
    wait_until(lambda: count_status(engine, "pending") == 0, 60, "the backlog to drain")
    # Retention, as the same role, deletes the published rows: read, mark and delete all work.
    wait_until(lambda: count_status(engine, "published") == 0, 30, "retention to delete them")
    assert count_status(engine, "failed") == 0


@pytest.mark.parametrize("table", ["agent_runs", "run_transitions", "step_results",
                                   "artifacts", "approvals"])
def test_the_relay_role_cannot_read_agent_state(database_url: str, relay_role: str,
                                                table: str) -> None:
    with (psycopg.connect(role_url(database_url, relay_role)) as conn,
          pytest.raises(psycopg.errors.InsufficientPrivilege)):
        conn.execute(f"SELECT 1 FROM outboxkit.{table} LIMIT 1")  # type: ignore[arg-type]


def test_the_relay_role_cannot_insert_messages(database_url: str, relay_role: str) -> None:
    with (psycopg.connect(role_url(database_url, relay_role)) as conn,
          pytest.raises(psycopg.errors.InsufficientPrivilege)):
        conn.execute("INSERT INTO outboxkit.outbox_messages (message_id, topic, lane, "
                     "message_type, payload) VALUES (gen_random_uuid(), 't', 0, 't', '')")
