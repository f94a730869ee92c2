"""`outbox ops list` / `resolve`: a human settles what the ledger could not, saying who and why."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import Engine, text

from dedup import OperationStatus, get_operation, operation_history
from dedup.operations import begin
from tests.integration.cli_support import one_line, outbox


@pytest.fixture
def stuck(engine: Engine) -> uuid.UUID:
    """An order whose outcome nobody could establish: needs-human."""
    with engine.begin() as conn:
        intent = begin(conn, key="place-order:m-1", system="supplier", operation="place-order",
                       request={"item": "widget", "qty": 3})
        begin(conn, key="place-order:m-2", system="supplier", operation="place-order",
              request={"item": "bolt", "qty": 1})
        conn.execute(text("UPDATE outboxkit.operations SET status = 'needs-human' WHERE id = :i"),
                     {"i": intent.operation.id})
    return intent.operation.id


def test_list_filters_by_status(stuck: uuid.UUID, database_url: str) -> None:
    table = outbox("ops", "list", "--database-url", database_url)
    assert table.returncode == 0, table.stderr
    assert str(stuck) in table.stdout
    assert "pending" in table.stdout
    waiting = outbox("ops", "list", "--status", "needs-human", "--json",
                     OUTBOXKIT_DATABASE_URL=database_url)
    assert [(o["id"], o["status"]) for o in json.loads(waiting.stdout)] == [
        (str(stuck), "needs-human")]


def test_resolve_confirmed_records_the_evidence_who_and_why(
    stuck: uuid.UUID, database_url: str, engine: Engine
) -> None:
    result = outbox("ops", "resolve", str(stuck), "--confirmed", "--evidence",
                    '{"reference": "PO-77", "seen_in": "supplier portal"}',
                    "--reason", "order visible in the portal", "--database-url", database_url,
                    USER="alice")
    assert result.returncode == 0, result.stderr
    assert "confirmed (by alice: order visible in the portal)" in result.stdout
    with engine.connect() as conn:
        op = get_operation(conn, stuck)
        last = operation_history(conn, stuck)[-1]
    assert op.status is OperationStatus.CONFIRMED
    assert (op.reference, op.resolved_by, op.resolution_reason) == (
        "PO-77", "alice", "order visible in the portal")
    assert (last.kind, last.actor, last.detail["seen_in"]) == (
        "resolution", "alice", "supplier portal")


def test_resolve_not_applied_needs_a_reason_and_records_the_actor(
    stuck: uuid.UUID, database_url: str, engine: Engine
) -> None:
    no_reason = outbox("ops", "resolve", str(stuck), "--not-applied", "--actor", "bob",
                       "--database-url", database_url)
    assert no_reason.returncode == 2
    result = outbox("ops", "resolve", str(stuck), "--not-applied", "--actor", "bob",
                    "--reason", "supplier support: no such order", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    with engine.connect() as conn:
        op = get_operation(conn, stuck)
    assert (op.status, op.resolved_by) == (OperationStatus.NOT_APPLIED, "bob")


def test_resolve_refuses_an_unknown_or_settled_operation_in_one_line(
    stuck: uuid.UUID, database_url: str
) -> None:
    missing = uuid.uuid4()
    unknown = outbox("ops", "resolve", str(missing), "--not-applied", "--reason", "x",
                     "--actor", "bob", "--database-url", database_url)
    assert unknown.returncode == 1
    assert f"no operation {missing}" in one_line(unknown)
    args = ("ops", "resolve", str(stuck), "--confirmed", "--evidence", '{"reference": "PO-1"}',
            "--actor", "bob", "--database-url", database_url)
    assert outbox(*args).returncode == 0
    twice = outbox(*args)
    assert twice.returncode == 1
    assert "already settled" in one_line(twice)
    bad_json = outbox("ops", "resolve", str(stuck), "--confirmed", "--evidence", "{nope",
                      "--actor", "bob", "--database-url", database_url)
    assert bad_json.returncode == 2
