"""`outbox ops list` / `resolve`: a human settles what the ledger could not, saying who and why."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import Engine, text

from dedup.ledger import Ledger, OperationStatus
from outbox.runs.lifecycle import get_run
from tests.integration.cli_support import one_line, outbox
from tests.integration.operations_support import waiting_run

LEDGER = Ledger()


@pytest.fixture
def stuck(engine: Engine) -> uuid.UUID:
    """An order whose outcome nobody could establish: needs-human."""
    with engine.begin() as conn:
        intent = LEDGER.begin(conn, key="place-order:m-1", system="supplier",
                              operation="place-order", request={"item": "widget", "qty": 3})
        LEDGER.begin(conn, key="place-order:m-2", system="supplier", operation="place-order",
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
        op = LEDGER.get_operation(conn, stuck)
        last = LEDGER.history(conn, stuck)[-1]
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
        op = LEDGER.get_operation(conn, stuck)
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


def test_list_shows_the_reason_and_last_error_in_the_table(
    stuck: uuid.UUID, database_url: str, engine: Engine
) -> None:
    """What a person needs to act on is in the table, not only in --json: the escalation's
    last error (on one line, cut) and the resolution's reason."""
    long_error = "outcome still unclear after 3 status queries: HTTP 503\n" + "x" * 500
    with engine.begin() as conn:
        conn.execute(text("UPDATE outboxkit.operations SET last_error = :e WHERE id = :i"),
                     {"e": long_error, "i": stuck})
    outbox("ops", "resolve", str(stuck), "--not-applied", "--actor", "bob", "--reason",
           "supplier support: no such order", "--database-url", database_url)
    table = outbox("ops", "list", "--database-url", database_url)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[-4:] == ["by", "reason", "last", "error"]
    [row] = [r for r in rows if r.startswith(str(stuck))]
    assert "supplier support: no such order" in row
    assert "outcome still unclear after 3 status queries: HTTP 503 xxx" in row
    assert "x" * 100 not in row  # cut, the full text is in --json
    assert row.endswith("…")


def test_list_is_newest_first_and_says_when_the_limit_cut_it(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        for n in range(5):
            LEDGER.begin(conn, key=f"place-order:m-{n}", system="supplier", operation="place-order",
                         request={"n": n})
        conn.execute(text("UPDATE outboxkit.operations SET created_at = created_at "
                          "+ make_interval(secs => (request->>'n')::int)"))
        ids = dict(conn.execute(text("SELECT idempotency_key, id::text "
                                     "FROM outboxkit.operations")).all())
    cut = outbox("ops", "list", "--limit", "2", "--database-url", database_url)
    assert cut.returncode == 0, cut.stderr
    lines = cut.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == [ids["place-order:m-4"],
                                                         ids["place-order:m-3"]]
    assert lines[-1] == "showing the newest 2 of 5 operations; --limit N for more"
    as_json = outbox("ops", "list", "--limit", "2", "--json", "--database-url", database_url)
    assert len(json.loads(as_json.stdout)) == 2  # stdout stays JSON, the note is on stderr
    assert "showing the newest 2 of 5" in as_json.stderr
    whole = outbox("ops", "list", "--limit", "5", "--database-url", database_url)
    assert "showing" not in whole.stdout
    assert len(whole.stdout.splitlines()) == 6


def test_resolve_says_what_happened_to_the_run(engine: Engine, database_url: str) -> None:
    """A person's resolution settles the run waiting on the operation: the command says so
    instead of sending them to Python to requeue it."""
    run_id = waiting_run(engine)
    with engine.begin() as conn:
        intent = LEDGER.begin(conn, key="place-order:m-9", system="supplier",
                              operation="place-order", request={"item": "widget", "qty": 3},
                              message_id="m-9", run_id=run_id)
    result = outbox("ops", "resolve", str(intent.operation.id), "--confirmed", "--evidence",
                    '{"reference": "PO-9"}', "--actor", "alice", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    assert f"its run {run_id} done" in result.stdout
    with engine.connect() as conn:
        run = get_run(conn, run_id)
    assert run.state.value == "done"
    assert run.last_evidence["reference"] == "PO-9"
