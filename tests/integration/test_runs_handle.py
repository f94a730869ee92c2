"""The run handle carries the lease: every write uses the current one, a taken-over handle
writes nothing, a spent one refuses (real PostgreSQL)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox import ClaimedRun, Envelope, LeaseLost, LeaseSpent, RetryPolicy, aio
from outbox.db.dsn import sqlalchemy_url
from outbox.db.tables import agent_runs, outbox_messages
from outbox.handle import claim
from outbox.runs.lifecycle import get_run, start_run
from tests.integration.conftest import Snapshot


def _queue(engine: Engine, key: str = "k") -> uuid.UUID:
    with engine.begin() as conn:
        return start_run(conn, workflow="wf", workflow_version="1", idempotency_key=key,
                         checkpoint={"at": 0}).id


def _claimed(engine: Engine, worker: str = "w", lease_seconds: float = 60) -> ClaimedRun:
    with engine.begin() as conn:
        job = claim(conn, worker=worker, lease_seconds=lease_seconds)
    assert job is not None
    return job


def _version(engine: Engine, run_id: uuid.UUID) -> int:
    with engine.connect() as conn:
        version: int = conn.execute(
            select(agent_runs.c.version).where(agent_runs.c.id == run_id)).scalar_one()
    return version


def _messages(engine: Engine) -> int:
    with engine.connect() as conn:
        count: int = conn.execute(select(func.count()).select_from(outbox_messages)).scalar_one()
    return count


def _order(run_id: uuid.UUID | None = None) -> Envelope:
    return Envelope(topic="order.submit", type="order.submit", key="acme", payload={"qty": 3},
                    run_id=run_id)


def test_the_lease_advances_across_writes_and_across_transactions(runs_engine: Engine) -> None:
    run_id = _queue(runs_engine)
    job = _claimed(runs_engine)
    claimed_version = job.lease.version
    with runs_engine.begin() as conn:
        work = job.on(conn)
        work.save_checkpoint({"at": 1}, step="planned")
        work.renew(60)
        step = work.run_step("ask", lambda: {"answer": 42})
        work.record("check", {"ok": True})
        assert step.value == {"answer": 42}
        assert work.lease.version == claimed_version + 4  # each fenced write bumped it
        assert job.lease.version == claimed_version  # the handle it came from is untouched
    assert _version(runs_engine, run_id) == work.lease.version
    with runs_engine.begin() as conn:  # the next transaction goes on from the committed lease
        later = work.on(conn)
        assert later.run_step("ask", lambda: {"answer": 0}).replayed
        later.emit(_order())
        later.transition("done", evidence={"ok": True})
    with runs_engine.connect() as conn:
        stored = get_run(conn, run_id)
    assert (stored.state, stored.step, stored.checkpoint) == ("done", "check", {"at": 1})
    assert _messages(runs_engine) == 1


def test_a_rolled_back_transaction_leaves_the_original_handle_usable(
        runs_engine: Engine) -> None:
    run_id = _queue(runs_engine)
    job = _claimed(runs_engine)
    with runs_engine.connect() as conn:  # the step failed: its transaction is rolled back
        job.on(conn).save_checkpoint({"at": 1})
        conn.rollback()
    with runs_engine.begin() as conn:
        outcome = job.on(conn).handle_failure(RuntimeError("the step failed"),
                                              policy=RetryPolicy(max_attempts=3))
    assert outcome.state == "queued"
    with runs_engine.connect() as conn:
        assert get_run(conn, run_id).attempts == 1


def test_emit_commits_with_the_state_change_and_a_rollback_leaves_neither(
        runs_engine: Engine) -> None:
    run_id = _queue(runs_engine)
    job = _claimed(runs_engine)
    with runs_engine.connect() as conn:  # a crash before the commit
        work = job.on(conn)
        work.emit_many([_order(), _order()])
        work.transition("waiting", step="order-submitted", evidence={"plan": "3"})
        conn.rollback()
    with runs_engine.connect() as conn:
        assert get_run(conn, run_id).state == "running"
    assert _messages(runs_engine) == 0
    with runs_engine.begin() as conn:
        work = job.on(conn)
        message_id = work.emit(_order())
        work.transition("waiting", step="order-submitted", evidence={"plan": "3"})
    with runs_engine.connect() as conn:
        assert get_run(conn, run_id).state == "waiting"
        row = conn.execute(select(outbox_messages.c.message_id, outbox_messages.c.run_id)).one()
    assert (row.message_id, row.run_id) == (message_id, run_id)  # the handle's run id


def test_a_taken_over_handle_writes_nothing_and_raises_lease_lost(
        runs_engine: Engine, snapshot: Snapshot) -> None:
    _queue(runs_engine)
    stale = _claimed(runs_engine, worker="A", lease_seconds=0.2)
    time.sleep(0.3)
    _claimed(runs_engine, worker="B")
    before = snapshot()
    writes: list[Callable[[ClaimedRun], object]] = [
        lambda h: h.save_checkpoint({"at": 9}), lambda h: h.emit(_order()),
        lambda h: h.transition("done", evidence={"by": "A"}), lambda h: h.renew(60)]
    for write in writes:
        with pytest.raises(LeaseLost), runs_engine.begin() as conn:
            write(stale.on(conn))
    assert snapshot() == before
    assert _messages(runs_engine) == 0


@pytest.mark.parametrize("end", ["transition", "release", "handle_failure", "revalidate"])
def test_a_spent_handle_refuses_every_write_before_sending_it(
        runs_engine: Engine, statements: list[str], end: str) -> None:
    _queue(runs_engine)
    job = _claimed(runs_engine)
    with runs_engine.begin() as conn:
        work = job.on(conn)
        if end == "transition":
            work.transition("waiting", step="asked", evidence={"q": 1})
        elif end == "release":
            work.release()
        elif end == "handle_failure":
            work.handle_failure(ValueError("bad"), policy=RetryPolicy(max_attempts=1))
        else:
            assert not work.revalidate(uuid.uuid4(), scope={"qty": 3}).valid
        assert work.spent
        assert "ended by" in repr(work)  # what a log line of the handle shows
        sent = len(statements)
        for write in (lambda: work.emit(_order()), lambda: work.save_checkpoint({}),
                      lambda: work.transition("done", evidence={}), lambda: work.renew(5),
                      lambda: work.on(conn).release()):
            with pytest.raises(LeaseSpent, match=r"already ended by"):
                write()
        assert len(statements) == sent  # refused in Python: nothing reached the database
    assert not job.spent  # the handle of the claim's transaction did not end anything


def test_the_async_handle_carries_the_lease_the_same_way(
        runs_engine: Engine, database_url: str) -> None:
    run_id = _queue(runs_engine)
    _queue(runs_engine, key="other")

    async def answer() -> dict[str, int]:
        return {"answer": 42}

    async def scenario() -> None:
        async_engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            await steps(async_engine)
        finally:
            await async_engine.dispose()  # inside the loop: no connection outlives it

    async def steps(async_engine: AsyncEngine) -> None:
        async with async_engine.begin() as conn:
            job = await aio.claim(conn, worker="a", lease_seconds=60)
            assert isinstance(job, aio.AsyncClaimedRun)
            assert job.run.id == run_id
            await job.save_checkpoint({"at": 1})
            assert (await job.run_step("ask", answer)).value == {"answer": 42}
            await job.renew(60)
        assert _version(runs_engine, run_id) == job.lease.version
        async with async_engine.connect() as conn:  # a crash before the commit
            await job.on(conn).emit(_order())
            await conn.rollback()
        assert _messages(runs_engine) == 0
        async with async_engine.begin() as conn:
            work = job.on(conn)
            await work.emit_many([_order()])
            await work.transition("done", evidence={"ok": True})
            with pytest.raises(LeaseSpent):
                await work.emit(_order())
        async with async_engine.begin() as conn:  # the other run, taken over after expiry
            stale = await aio.claim(conn, worker="b", lease_seconds=0.2)
        assert stale is not None
        await asyncio.sleep(0.3)
        async with async_engine.begin() as conn:
            assert await aio.claim(conn, worker="c", lease_seconds=60) is not None
        with pytest.raises(LeaseLost):
            async with async_engine.begin() as conn:
                await stale.on(conn).save_checkpoint({"at": 9})

    asyncio.run(scenario())
    with runs_engine.connect() as conn:
        assert get_run(conn, run_id).state == "done"
    assert _messages(runs_engine) == 1
