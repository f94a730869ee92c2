"""Retention purges checkpoints of finished runs; history and key tombstones stay."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from sqlalchemy import Engine, func, select, update
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import aio
from outbox.db.dsn import sqlalchemy_url
from outbox.db.tables import agent_runs, run_archive, run_transitions, step_results
from outbox.runs import lifecycle as runs
from outbox.runs import retention, steps


def _finished(engine: Engine, key: str, *, days_ago: int) -> runs.Run:
    with engine.begin() as conn:
        run = runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key=key,
                             checkpoint={"big": "state"})
        got = runs.claim(conn, worker="w", lease_seconds=60)
        assert got is not None
        lease = steps.record(conn, got.lease, "s1", {"answer": 42})
        runs.transition(conn, lease, "done", evidence={"ok": True})
        conn.execute(update(agent_runs).where(agent_runs.c.id == run.id)
                     .values(finished_at=func.now() - timedelta(days=days_ago)))
    return run


def _count(engine: Engine, table) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_purge_drops_old_checkpoints_and_step_results_but_keeps_history(
        runs_engine: Engine) -> None:
    old = _finished(runs_engine, "old", days_ago=40)
    young = _finished(runs_engine, "young", days_ago=1)
    with runs_engine.begin() as conn:
        runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="queued")
    history_before = _count(runs_engine, run_transitions)
    purged = retention.purge(runs_engine, older_than=timedelta(days=30), batch_size=1,
                             archive=True)
    assert purged == 1
    with runs_engine.connect() as conn:
        stored_old = runs.get_run(conn, old.id)
        stored_young = runs.get_run(conn, young.id)
        archived = conn.execute(select(run_archive)).one()
        kept = conn.execute(select(step_results.c.run_id)).scalars().all()
    assert stored_old.purged
    assert stored_old.checkpoint is None
    assert stored_old.last_evidence == {"ok": True}
    assert not stored_young.purged
    assert stored_young.checkpoint == {"big": "state"}
    assert kept == [young.id]
    assert (archived.run_id, archived.checkpoint, archived.step_results) == (
        old.id, {"big": "state"}, {"s1": {"answer": 42}})
    assert _count(runs_engine, run_transitions) == history_before


def test_a_reused_key_after_purge_returns_the_tombstone_and_does_not_replay(
        runs_engine: Engine) -> None:
    old = _finished(runs_engine, "order-7", days_ago=40)
    assert retention.purge(runs_engine, older_than=timedelta(days=30)) == 1
    with runs_engine.begin() as conn:
        again = runs.start_run(conn, workflow="wf", workflow_version="1",
                               idempotency_key="order-7", checkpoint={"fresh": True})
        assert runs.claim(conn, worker="w", lease_seconds=60) is None
    assert again.id == old.id
    assert again.purged
    assert again.checkpoint is None
    assert _count(runs_engine, agent_runs) == 1


def test_purge_batches_until_nothing_is_left(runs_engine: Engine) -> None:
    for i in range(5):
        _finished(runs_engine, f"k{i}", days_ago=40)
    assert retention.purge(runs_engine, older_than=timedelta(days=30), batch_size=2) == 5
    assert retention.purge(runs_engine, older_than=timedelta(days=30), batch_size=2) == 0


def test_the_async_purge_batches_the_same_way(runs_engine: Engine, database_url: str) -> None:
    for i in range(5):
        _finished(runs_engine, f"k{i}", days_ago=40)
    seen: list[int] = []

    async def purge_twice() -> tuple[int, int, int]:
        engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with engine.connect() as conn:
                dry = await aio.purgeable(conn, older_than=timedelta(days=30))
            first = await aio.purge(engine, older_than=timedelta(days=30), batch_size=2,
                                    on_batch=seen.append)
            return dry, first, await aio.purge(engine, older_than=timedelta(days=30))
        finally:
            await engine.dispose()

    assert asyncio.run(purge_twice()) == (5, 5, 0)
    assert seen == [2, 2, 1]  # a short batch ends the loop
