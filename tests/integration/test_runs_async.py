"""The async twin runs the same plans on AsyncConnection and AsyncSession (real PostgreSQL)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from outbox import aio
from outbox.db.dsn import sqlalchemy_url
from outbox.errors import LeaseLost
from outbox.runs.retry import RetryPolicy
from outbox.runs.states import RunState
from outbox.runs.workflows import Workflow


def test_async_run_claims_records_a_step_once_and_finishes(database_url: str,
                                                           runs_engine: object) -> None:
    async def scenario() -> None:
        engine = create_async_engine(sqlalchemy_url(database_url))
        calls: list[str] = []

        async def tool() -> dict[str, int]:
            calls.append("tool")
            return {"n": 1}

        try:
            async with engine.begin() as conn:
                await aio.register(conn, Workflow(name="wf", version="1"))
                run = await aio.start_run(conn, workflow="wf", workflow_version="1",
                                          idempotency_key="k", checkpoint={"at": 0})
                again = await aio.start_run(conn, workflow="wf", workflow_version="1",
                                            idempotency_key="k")
                assert again.id == run.id
            async with engine.begin() as conn:
                got = await aio.claim(conn, worker="a", lease_seconds=60)
                assert got is not None
                step = await aio.run_step(conn, got.lease, "s1", tool)
                replay = await aio.run_step(conn, step.lease, "s1", tool)
                assert (step.replayed, replay.replayed, replay.value) == (False, True, {"n": 1})
                lease = await aio.save_checkpoint(conn, step.lease, {"at": 1}, step="s1")
                lease = await aio.renew(conn, lease, 60)
                ref = await aio.store_artifact(conn, b"blob")
                assert await aio.load_artifact(conn, ref) == b"blob"
                await aio.transition(conn, lease, "done", evidence={"ok": True})
            async with AsyncSession(engine) as session:
                stored = await aio.get_run(session, run.id)
                history = await aio.history(session, run.id)
                recorded = await aio.recorded(session, run.id, "s1")
            assert calls == ["tool"]
            assert stored.state is RunState.DONE
            assert stored.checkpoint == {"at": 1}
            assert [h.to_state for h in history] == ["queued", "running", "done"]
            assert recorded is not None
            assert recorded.result == {"n": 1}
        finally:
            await engine.dispose()

    asyncio.run(scenario())


def test_async_stale_lease_and_retry_and_approval_paths(database_url: str,
                                                        runs_engine: object) -> None:
    async def scenario() -> None:
        engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with engine.begin() as conn:
                await aio.start_run(conn, workflow="wf", workflow_version="1",
                                    idempotency_key="k")
                first = await aio.claim(conn, worker="a", lease_seconds=0.1)
                assert first is not None
            await asyncio.sleep(0.2)
            async with engine.begin() as conn:
                second = await aio.claim(conn, worker="b", lease_seconds=60)
                assert second is not None
                with pytest.raises(LeaseLost):
                    await aio.transition(conn, first.lease, "done", evidence={})
                failure = await aio.handle_failure(
                    conn, second.lease, TimeoutError("slow"),
                    policy=RetryPolicy(initial_backoff=0, max_attempts=2))
                assert (failure.state, failure.attempts) == (RunState.QUEUED, 1)
            async with engine.begin() as conn:
                third = await aio.claim(conn, worker="c", lease_seconds=60)
                assert third is not None
                approval = await aio.request_approval(conn, third.run.id, scope={"tool": "x"},
                                                      expires_at=timedelta(hours=1))
                lease = await aio.transition(conn, third.lease, "waiting")
                await aio.grant(conn, approval.id, by="alice")
                await aio.revoke(conn, approval.id, by="bob")
            async with engine.begin() as conn:
                fourth = await aio.claim(conn, worker="d", lease_seconds=60)
                assert fourth is not None
                assert fourth.lease.token == lease.token + 1
                check = await aio.revalidate(conn, fourth.lease, approval.id, scope={"tool": "x"})
                assert check.state is RunState.NEEDS_HUMAN
                run = await aio.move(conn, third.run.id, "failed", actor="ops")
                assert run.state is RunState.FAILED
                assert await aio.purge_batch(conn, older_than=timedelta(0)) == 0  # same tx clock
        finally:
            await engine.dispose()

    asyncio.run(scenario())
