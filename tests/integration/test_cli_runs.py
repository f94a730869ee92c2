"""`outbox runs list` / `outbox runs show`: what an operator sees of runs, on real PostgreSQL."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import Engine

from outbox import claim, start_run, transition
from tests.integration.cli_support import one_line, outbox


@pytest.fixture
def finished_run(engine: Engine) -> uuid.UUID:
    """A run that waited for its order, then finished with the supplier's reference."""
    with engine.begin() as conn:
        start_run(conn, workflow="supplier-order", workflow_version="3", idempotency_key="t-812",
                  checkpoint={"plan": "order 3 widgets"})
        start_run(conn, workflow="other", workflow_version="1", idempotency_key="t-900")
    with engine.begin() as conn:
        job = claim(conn, worker="worker-1", lease_seconds=30, workflows=["supplier-order"])
        assert job is not None
        transition(conn, job.lease, "waiting", step="order-submitted",
                   evidence={"plan": "order 3 widgets"}, wake_at=None)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outboxkit.agent_runs SET not_before = now()")
        job = claim(conn, worker="worker-2", lease_seconds=30, workflows=["supplier-order"])
        assert job is not None
        transition(conn, job.lease, "done", step="order-confirmed",
                   evidence={"supplier_ref": "PO-77"})
    return job.run.id


def test_list_shows_each_run_with_its_state_and_filters_by_state(
    finished_run: uuid.UUID, database_url: str
) -> None:
    table = outbox("runs", "list", "--database-url", database_url)
    assert table.returncode == 0, table.stderr
    assert str(finished_run) in table.stdout
    assert "supplier-order@3" in table.stdout
    assert "order-confirmed" in table.stdout
    done = outbox("runs", "list", "--state", "done", "--json", OUTBOXKIT_DATABASE_URL=database_url)
    assert done.returncode == 0, done.stderr
    assert [(r["id"], r["state"], r["workflow"]) for r in json.loads(done.stdout)] == [
        (str(finished_run), "done", "supplier-order")]


def test_show_prints_the_path_to_the_final_state_with_each_transitions_evidence(
    finished_run: uuid.UUID, database_url: str
) -> None:
    shown = outbox("runs", "show", str(finished_run), "--database-url", database_url)
    assert shown.returncode == 0, shown.stderr
    assert '{"supplier_ref":"PO-77"}' in shown.stdout  # last evidence and the final move
    assert '{"plan":"order 3 widgets"}' in shown.stdout
    for move in ("∅ → queued", "queued → running", "running → waiting", "waiting → running",
                 "running → done"):
        assert move in shown.stdout, move
    as_json = outbox("runs", "show", str(finished_run), "--json", "--database-url", database_url)
    data = json.loads(as_json.stdout)
    assert data["state"] == "done"
    assert data["checkpoint_bytes"] > 0
    assert [(t["from_state"], t["to_state"]) for t in data["history"]] == [
        (None, "queued"), ("queued", "running"), ("running", "waiting"),
        ("waiting", "running"), ("running", "done")]
    assert data["history"][-1]["evidence"] == {"supplier_ref": "PO-77"}


def test_show_of_an_unknown_run_is_one_line_and_exit_1(database_url: str) -> None:
    missing = uuid.uuid4()
    result = outbox("runs", "show", str(missing), "--database-url", database_url)
    assert result.returncode == 1
    assert f"run {missing} does not exist" in one_line(result)


def test_show_of_a_malformed_id_is_a_usage_error(database_url: str) -> None:
    result = outbox("runs", "show", "not-a-uuid", "--database-url", database_url)
    assert result.returncode == 2
    assert "not a valid UUID" in result.stderr
