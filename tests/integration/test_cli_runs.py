"""`outbox runs list` / `outbox runs show`: what an operator sees of runs, on real PostgreSQL."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine

from dedup.ledger import Ledger
from outbox.db.execution import run_plan
from outbox.handle import claim
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from outbox.runs.children import start_many_plan
from outbox.runs.lifecycle import start_run, transition
from relay.claims import Published, claim_messages, record
from relay.lanes import LaneManager
from tests.integration.cli_support import one_line, outbox
from tests.integration.relay_support import pool_of

LEDGER = Ledger()


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


# --- outbox runs requeue --------------------------------------------------------------------


def _run_in(engine: Engine, state: str, key: str) -> uuid.UUID:
    """A run claimed by a worker, then moved to *state* by it."""
    with engine.begin() as conn:
        start_run(conn, workflow="supplier-order", workflow_version="3", idempotency_key=key)
    with engine.begin() as conn:
        job = claim(conn, worker="worker-1", lease_seconds=30, workflows=["supplier-order"])
        assert job is not None
        evidence = {"supplier_ref": "PO-1"} if state == "done" else None
        transition(conn, job.lease, state, step="order-submitted", reason="supplier unclear",
                   evidence=evidence)
    return job.run.id


@pytest.mark.parametrize("state", ["failed", "needs-human"])
def test_requeue_puts_a_failed_or_parked_run_back_in_the_queue_with_who_and_why(
    engine: Engine, database_url: str, state: str
) -> None:
    run_id = _run_in(engine, state, f"rq-{state}")
    result = outbox("runs", "requeue", str(run_id), "--reason", "supplier confirmed PO-77",
                    "--actor", "alice", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"run {run_id}: {state} → queued (by alice: supplier confirmed PO-77)")
    shown = json.loads(outbox("runs", "show", str(run_id), "--json",
                              "--database-url", database_url).stdout)
    assert shown["state"] == "queued"
    assert shown["attempts"] == 0
    last = shown["history"][-1]
    assert (last["from_state"], last["to_state"], last["actor"], last["reason"]) == (
        state, "queued", "alice", "supplier confirmed PO-77")
    with engine.begin() as conn:  # a worker can claim it again
        job = claim(conn, worker="worker-2", lease_seconds=30, workflows=["supplier-order"])
    assert job is not None
    assert job.run.id == run_id


def test_requeue_of_a_run_in_another_state_names_its_state_and_what_is_allowed(
    engine: Engine, database_url: str
) -> None:
    run_id = _run_in(engine, "done", "rq-done")
    result = outbox("runs", "requeue", str(run_id), "--reason", "again",
                    "--database-url", database_url, USER="bob")
    assert result.returncode == 1
    line = one_line(result)
    assert f"run {run_id} is 'done'" in line
    assert "only a run that is failed or needs-human can be requeued" in line
    assert "nothing was written" in line
    shown = json.loads(outbox("runs", "show", str(run_id), "--json",
                              "--database-url", database_url).stdout)
    assert shown["state"] == "done"


def test_requeue_of_an_unknown_run_is_one_line_and_exit_1(database_url: str) -> None:
    missing = uuid.uuid4()
    result = outbox("runs", "requeue", str(missing), "--reason", "x", "--actor", "alice",
                    "--database-url", database_url)
    assert result.returncode == 1
    assert f"run {missing} does not exist" in one_line(result)


def test_requeue_needs_a_reason_and_someone_to_record(engine: Engine, database_url: str) -> None:
    run_id = _run_in(engine, "failed", "rq-usage")
    no_reason = outbox("runs", "requeue", str(run_id), "--actor", "alice",
                       "--database-url", database_url)
    assert no_reason.returncode == 2
    assert "--reason" in no_reason.stderr
    blank = outbox("runs", "requeue", str(run_id), "--reason", "  ", "--actor", "alice",
                   "--database-url", database_url)
    assert blank.returncode == 2
    assert "--reason" in blank.stderr
    nobody = outbox("runs", "requeue", str(run_id), "--reason", "fixed",
                    "--database-url", database_url, USER="")  # no --actor and no $USER
    assert nobody.returncode == 2
    assert "--actor" in nobody.stderr
    shown = json.loads(outbox("runs", "show", str(run_id), "--json",
                              "--database-url", database_url).stdout)
    assert shown["state"] == "failed"


def test_requeue_refuses_a_run_whose_operation_has_no_settled_outcome_unless_forced(
    engine: Engine, database_url: str
) -> None:
    """Its worker would decide again and could place a second order while the first one's
    outcome is still to be learnt: settle the operation first (that settles the run)."""
    run_id = _run_in(engine, "needs-human", "rq-open-op")
    with engine.begin() as conn:
        intent = LEDGER.begin(conn, key=f"place:{run_id}", system="supplier",
                              operation="place-order", request={"item": "widget"}, run_id=run_id,
                              message_id=str(uuid.uuid4()))
    refused = outbox("runs", "requeue", str(run_id), "--reason", "again", "--actor", "alice",
                     "--database-url", database_url)
    assert refused.returncode == 1
    line = one_line(refused)
    op_id = intent.operation.id
    assert f"operation {op_id} (place-order on supplier) that is still pending" in line
    assert f"outbox ops resolve {intent.operation.id}" in line
    shown = json.loads(outbox("runs", "show", str(run_id), "--json",
                              "--database-url", database_url).stdout)
    assert shown["state"] == "needs-human"
    forced = outbox("runs", "requeue", str(run_id), "--reason", "again", "--actor", "alice",
                    "--force", "--database-url", database_url)
    assert forced.returncode == 0, forced.stderr


def test_show_lists_the_runs_messages_with_the_brokers_proof_once_published(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        start_run(conn, workflow="supplier-order", workflow_version="3", idempotency_key="t-5")
    with engine.begin() as conn:
        job = claim(conn, worker="w", lease_seconds=30, workflows=["supplier-order"])
        assert job is not None
        for n in range(2):
            emit(conn, Envelope(topic="order.submit", type="order.submit", key="acme",
                                payload={"n": n}), lease=job.lease)
    run_id = job.run.id
    before = json.loads(outbox("runs", "show", str(run_id), "--json",
                               "--database-url", database_url).stdout)
    assert [(m["status"], m["kafka_offset"]) for m in before["messages"]] == [("pending", None)] * 2
    publish_everything(engine, offset=40)  # as the relay records what Kafka acknowledged
    shown = outbox("runs", "show", str(run_id), "--database-url", database_url)
    assert shown.returncode == 0, shown.stderr
    assert "published" in shown.stdout
    after = json.loads(outbox("runs", "show", str(run_id), "--json",
                              "--database-url", database_url).stdout)
    assert [(m["status"], m["kafka_partition"]) for m in after["messages"]] == [
        ("published", 3)] * 2
    assert sorted(m["kafka_offset"] for m in after["messages"]) == [40, 41]
    listed = json.loads(outbox("messages", "list", "--published", "--json",
                               "--database-url", database_url).stdout)
    assert sorted(m["kafka_offset"] for m in listed) == [40, 41]


def publish_everything(engine: Engine, *, offset: int) -> None:
    """Read every lane's difference and record it as acknowledged at partition 3."""
    pool = pool_of(engine)
    lanes = LaneManager(pool, schema="outboxkit", relay_id="r", lanes=64, lease_seconds=30,
                        host="h", pid=1)
    lanes.heartbeat()
    with pool.begin() as conn:
        batch = claim_messages(conn, "outboxkit", relay_id="r", cursors=lanes.owned(), limit=100)
        record(conn, "outboxkit", relay_id="r",
               published=[Published(r, 3, offset + i) for i, r in enumerate(batch.rows)],
               failed=[], set_aside=[], blocking=False, incarnation=batch.incarnation,
               cursors={lane: (read_.advanced(read_.ids[-1]), len(read_.ids))
                        for lane, read_ in batch.reads.items() if read_.ids})


def test_cancel_fails_a_waiting_run_with_who_and_why_and_a_finished_one_is_refused(
    engine: Engine, database_url: str
) -> None:
    waiting = _run_in(engine, "waiting", "cx-waiting")
    with engine.begin() as conn:  # and one that a worker has not taken yet
        queued = start_run(conn, workflow="supplier-order", workflow_version="3",
                           idempotency_key="cx-queued").id
    for run_id in (waiting, queued):
        result = outbox("runs", "cancel", str(run_id), "--reason", "customer withdrew",
                        "--actor", "alice", "--database-url", database_url)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"run {run_id} (supplier-order): failed"
        shown = json.loads(outbox("runs", "show", str(run_id), "--json",
                                  "--database-url", database_url).stdout)
        last = shown["history"][-1]
        assert (shown["state"], last["actor"], last["reason"]) == (
            "failed", "alice", "customer withdrew")
    again = outbox("runs", "cancel", str(waiting), "--database-url", database_url, USER="bob")
    assert again.returncode == 1
    assert "'failed'" in one_line(again)


def test_keep_effect_lets_a_compensating_runs_effect_stay_only_while_a_person_holds_it(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        start_run(conn, workflow="supplier-order", workflow_version="3", idempotency_key="ke")
    with engine.begin() as conn:
        job = claim(conn, worker="worker-1", lease_seconds=30, workflows=["supplier-order"])
        assert job is not None
        sent = job.emit(Envelope(topic="t", type="reserve", key="k", payload={}),
                        compensation=Envelope(topic="t", type="release", key="k", payload={}))
        job.transition("waiting", step="reserve")
    args = ["runs", "keep-effect", str(job.run.id), str(sent), "--reason", "no such hold",
            "--actor", "alice", "--database-url", database_url]
    refused = outbox(*args)
    assert refused.returncode == 1
    assert "not compensating" in one_line(refused)
    with engine.begin() as conn:  # compensating, and a person holds it
        conn.exec_driver_sql("UPDATE outboxkit.agent_runs SET state = 'needs-human', "
                             "compensating_since = now()")
    kept = outbox(*args)
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.startswith(f"run {job.run.id}: reserve ({sent}) kept; requeue the run")
    with engine.connect() as conn:
        state, evidence = conn.exec_driver_sql(
            "SELECT state, compensation_evidence FROM outboxkit.run_effects").one()
    assert (state, evidence) == ("kept", {"kept_by": "alice", "reason": "no such hold"})
    again = outbox(*args)
    assert again.returncode == 1
    assert "no effect" in one_line(again)
    shown = json.loads(outbox("runs", "show", str(job.run.id), "--json",
                              "--database-url", database_url).stdout)
    assert [(e["type"], e["message_id"], e["state"]) for e in shown["effects"]] == [
        ("reserve", str(sent), "kept")]
    table = outbox("runs", "show", str(job.run.id), "--database-url", database_url).stdout
    assert "undo's evidence" in table
    assert "no such hold" in table


def test_list_and_show_say_which_children_their_parents_bound_holds(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        start_run(conn, workflow="supplier-order", workflow_version="3", idempotency_key="pa")
    with engine.begin() as conn:
        job = claim(conn, worker="worker-1", lease_seconds=30, workflows=["supplier-order"])
        assert job is not None
        kids = _two_children(conn, job)
    listed = outbox("runs", "list", "--state", "queued", "--database-url", database_url).stdout
    assert listed.count("queued (held)") == 1
    shown = json.loads(outbox("runs", "show", str(kids[1].id), "--json",
                              "--database-url", database_url).stdout)
    assert shown["held"] is True
    table = outbox("runs", "show", str(kids[1].id), "--database-url", database_url).stdout
    assert "queued (held)" in table


def _two_children(conn: Any, job: Any) -> list[Any]:
    """Two children of *job*'s run, at most one at a time: the second starts held."""
    pins = {"workflow": "supplier-order", "workflow_version": "3", "prompt_version": None,
            "tool_schema_version": None}
    return run_plan(conn, start_many_plan(job.lease, [("a", None), ("b", None)], pins=pins,
                                          concurrency=1, settings=None))
