"""The run claim follows its indexes in claim order (migration 0007) and still takes the oldest
claimable run across states (real PostgreSQL)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, insert, text

from outbox.db import execution
from outbox.db.tables import agent_runs
from outbox.runs import lifecycle as runs
from outbox.runs import workflows

_T0 = datetime(2026, 1, 1, tzinfo=UTC)
_PAST = datetime(2000, 1, 1, tzinfo=UTC)
_FUTURE = datetime(2999, 1, 1, tzinfo=UTC)


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def test_a_claim_with_a_deep_queue_reads_the_claim_index_not_the_whole_table(
        runs_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # 50,000 queued runs, and beside them runs that are not due: far timers, delayed
    # retries, live leases. None of them may be read by a sequential scan or sorted.
    with runs_engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO outboxkit.agent_runs
                (id, workflow, workflow_version, state, idempotency_key, created_at,
                 not_before, lease_owner, lease_expires_at)
            SELECT gen_random_uuid(), 'deep', '1',
                   CASE g % 100 WHEN 1 THEN 'running' WHEN 2 THEN 'waiting' ELSE 'queued' END,
                   'deep-' || g, now() - interval '1 day' + g * interval '1 ms',
                   CASE WHEN g % 100 IN (2, 3) THEN now() + interval '1 day' END,
                   CASE WHEN g % 100 = 1 THEN 'w' END,
                   CASE WHEN g % 100 = 1 THEN now() + interval '1 hour' END
            FROM generate_series(1, 50000) AS g"""))
        conn.execute(text("ANALYZE outboxkit.agent_runs"))
    nodes = _claim_plan(runs_engine, monkeypatch)
    shape = [(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes]
    indexes = {n.get("Index Name") for n in nodes}
    assert "agent_runs_claim_queued_idx" in indexes, shape
    assert "agent_runs_claim_expired_idx" in indexes, shape
    assert ("Seq Scan", "agent_runs", None) not in shape, str(shape)
    # The queued backlog is merged in index order, not sorted.
    assert any(n["Node Type"] == "Merge Append" for n in nodes), shape


def test_a_fresh_backlog_of_one_workflow_fetches_each_candidate_by_its_key(
        runs_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape of a queue filled at once and analysed, claimed for named workflows (what the
    worker sends): the candidate's row is fetched by primary key, never by a scan of the
    table joined to the probes (which read dead rows of every claimed run on each claim)."""
    with runs_engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO outboxkit.agent_runs
                (id, workflow, workflow_version, state, idempotency_key, created_at)
            SELECT gen_random_uuid(), 'fresh', '1', 'queued', 'fresh-' || g,
                   now() - interval '1 day' + g * interval '1 ms'
            FROM generate_series(1, 6000) AS g"""))
    with runs_engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text("VACUUM ANALYZE outboxkit.agent_runs"))
    nodes = _claim_plan(runs_engine, monkeypatch, names=["fresh"])
    shape = [(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes]
    assert ("Seq Scan", "agent_runs", None) not in shape, str(shape)
    assert ("Index Scan", "agent_runs", "agent_runs_pkey") in shape, str(shape)


def _claim_plan(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                names: list[str] | None = None) -> list[dict[str, Any]]:
    """The nodes of the plan of the claim statement a claim sends (EXPLAIN, its parameters)."""
    sent: list[tuple[str, Any]] = []
    # The claim is a named statement sent straight to psycopg (SQLAlchemy's statement events
    # do not see it): record what it sends.
    send = execution.driver_row

    def record(conn: Any, sql: str, params: Any) -> Any:
        sent.append((sql, params))
        return send(conn, sql, params)

    monkeypatch.setattr(execution, "driver_row", record)
    definitions = None if names is None else [
        workflows.Workflow(name=name, version="1") for name in names]
    with engine.connect() as conn, conn.begin() as tx:
        assert runs.claim(conn, worker="w", lease_seconds=60, workflows=definitions) is not None
        (statement, parameters), = sent
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
        row = cursor.fetchone()
        assert row is not None
        tx.rollback()
    return list(_nodes(row[0][0]["Plan"]))


def _run(conn: Any, name: str, minute: int, state: str, *, workflow: str = "w",
         not_before: datetime | None = None, lease_expires_at: datetime | None = None) -> None:
    conn.execute(insert(agent_runs).values(
        id=uuid.uuid4(), workflow=workflow, workflow_version="1", state=state,
        idempotency_key=name, created_at=_T0 + timedelta(minutes=minute),
        not_before=not_before, lease_expires_at=lease_expires_at,
        lease_owner="gone" if state == "running" else None))


def test_claims_take_the_oldest_due_run_across_states_and_skip_runs_not_due(
        runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        # Not due, and older than every due run: a claim must pass over them.
        _run(conn, "queued-later", 0, "queued", not_before=_FUTURE)
        _run(conn, "waiting-later", 1, "waiting", not_before=_FUTURE)
        _run(conn, "waiting-for-a-person", 2, "waiting")
        _run(conn, "running-live", 3, "running", lease_expires_at=_FUTURE)
        # Due, one of each way, created in this order.
        _run(conn, "waiting-woken", 4, "waiting", not_before=_PAST)
        _run(conn, "running-expired", 5, "running", lease_expires_at=_PAST)
        _run(conn, "queued-delayed", 6, "queued", not_before=_PAST)
        _run(conn, "queued", 7, "queued")
        _run(conn, "running-no-lease", 8, "running")
        _run(conn, "queued-newest", 9, "queued")
        # Due but not claimable: another workflow (filtered out), a retired one.
        _run(conn, "other-workflow", 0, "queued", workflow="other")
        _run(conn, "retired-workflow", 0, "queued", workflow="old")
        workflows.register(conn, workflows.Workflow(name="old", version="1", retired=True))

    order = []
    with runs_engine.connect() as holder:
        # A run locked by another claimer's open transaction is skipped, not waited for,
        # and the next one in order is taken.
        holding = holder.begin()
        held = runs.claim(holder, worker="holder", lease_seconds=60, workflows=["w"])
        assert held is not None
        assert held.run.idempotency_key == "waiting-woken"
        while True:
            with runs_engine.begin() as conn:
                got = runs.claim(conn, worker="w", lease_seconds=60, workflows=["w"])
                if got is None:
                    break
                order.append(got.run.idempotency_key)
                runs.transition(conn, got.lease, "done", evidence={})
        holding.rollback()
    assert order == ["running-expired", "queued-delayed", "queued", "running-no-lease",
                     "queued-newest"]
    with runs_engine.begin() as conn:
        rest = [runs.claim(conn, worker="w", lease_seconds=60) for _ in range(3)]
    # The holder rolled back: its run is claimable again; the retired workflow's never is.
    assert [c and c.run.idempotency_key for c in rest] == ["other-workflow", "waiting-woken",
                                                            None]
