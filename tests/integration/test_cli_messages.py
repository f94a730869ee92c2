"""`outbox messages list` / `retry`: the outbox backlog and its failures, on real PostgreSQL."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import Engine, text

from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from tests.integration.cli_support import one_line, outbox, refuse


@pytest.fixture
def failed_id(engine: Engine) -> int:
    """Three messages of one key; the first was refused by Kafka and holds back the others."""
    with engine.begin() as conn:
        for i in range(3):
            emit(conn, Envelope(topic="order.submit", type="order.submit", key="acme",
                                payload={"i": i}))
        emit(conn, Envelope(topic="other", type="other", key="x", payload={}))
        first = conn.execute(text("SELECT min(id) FROM outboxkit.outbox_messages")).scalar_one()
        refuse(conn, first, error="topic order.submit does not exist", blocking=True)
        return first


def test_list_pending_and_failed_filter_by_topic(failed_id: int, database_url: str) -> None:
    pending = outbox("messages", "list", "--pending", "--topic", "order.submit", "--json",
                     "--database-url", database_url)
    assert pending.returncode == 0, pending.stderr
    rows = json.loads(pending.stdout)
    assert [(r["topic"], r["key"], r["status"]) for r in rows] == [
        ("order.submit", "acme", "pending")] * 2
    failed = outbox("messages", "list", "--failed", OUTBOXKIT_DATABASE_URL=database_url)
    assert failed.returncode == 0, failed.stderr
    assert "topic order.submit does not exist" in failed.stdout
    assert str(failed_id) in failed.stdout


def test_retry_sets_the_failed_message_pending_and_clears_blocking(
    failed_id: int, database_url: str, engine: Engine
) -> None:
    result = outbox("messages", "retry", str(failed_id), "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    assert "retried 1 message" in result.stdout
    with engine.connect() as conn:
        row = conn.execute(text("SELECT status, blocking, last_error FROM "
                                "outboxkit.message_status WHERE id = :id"),
                           {"id": failed_id}).one()
    assert tuple(row) == ("pending", False, None)
    none_left = outbox("messages", "retry", "--all-failed", "--database-url", database_url)
    assert "retried 0 messages" in none_left.stdout


def test_retry_refuses_ids_that_are_not_failed_and_changes_nothing(
    failed_id: int, database_url: str, engine: Engine
) -> None:
    result = outbox("messages", "retry", str(failed_id), str(failed_id + 1), "999999",
                    "--database-url", database_url)
    assert result.returncode == 1
    error = one_line(result)
    assert f"{failed_id + 1} (pending)" in error
    assert "999999 (no such message)" in error
    with engine.connect() as conn:
        status = conn.execute(text("SELECT status FROM outboxkit.message_status WHERE id = :id"),
                              {"id": failed_id}).scalar_one()
    assert status == "failed"


def test_all_failed_retries_every_failed_message(failed_id: int, database_url: str) -> None:
    result = outbox("messages", "retry", "--all-failed", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    assert "retried 1 message" in result.stdout


def test_list_without_pending_or_failed_and_retry_without_ids_are_usage_errors(
    database_url: str,
) -> None:
    assert outbox("messages", "list", "--database-url", database_url).returncode == 2
    assert outbox("messages", "retry", "--database-url", database_url).returncode == 2
