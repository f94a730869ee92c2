"""outbox.aio.save_checkpoint's one-statement write keeps the fence of the sync path
(real PostgreSQL): the same run, lease token and version, running, not purged."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import aio
from outbox.db.dsn import sqlalchemy_url
from outbox.errors import CheckpointTooLarge, IllegalTransition, LeaseLost, SchemaError
from outbox.settings import OutboxSettings


def _scenario(database_url: str, body: Any) -> None:
    async def main() -> None:
        engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with engine.begin() as conn:
                await aio.start_run(conn, workflow="wf", workflow_version="1",
                                    idempotency_key="k", checkpoint={"at": 0})
            async with engine.begin() as conn:
                job = await aio.claim(conn, worker="a", lease_seconds=60)
                assert job is not None
            await body(engine, job)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_a_save_advances_the_lease_and_keeps_the_step_unless_given(database_url: str,
                                                                   engine: object) -> None:
    async def body(engine: Any, job: Any) -> None:
        async with engine.begin() as conn:
            lease = await aio.save_checkpoint(conn, job.lease, {"at": 1}, step="one")
            assert (lease.token, lease.version) == (job.lease.token, job.lease.version + 1)
            assert lease.expires_at == job.lease.expires_at
            lease = await aio.save_checkpoint(conn, lease, {"at": 2, "text": "é"})
        async with engine.connect() as conn:
            run = await aio.get_run(conn, job.run.id)
        assert (run.checkpoint, run.step) == ({"at": 2, "text": "é"}, "one")
        async with engine.begin() as conn:
            lease = await aio.save_checkpoint(conn, lease, None)
        async with engine.connect() as conn:
            assert (await aio.get_run(conn, job.run.id)).checkpoint is None

    _scenario(database_url, body)


def test_a_stale_lease_a_finished_run_and_an_oversized_checkpoint_write_nothing(
        database_url: str, engine: object) -> None:
    async def body(engine: Any, job: Any) -> None:
        async with engine.begin() as conn:
            fresh = await aio.save_checkpoint(conn, job.lease, {"at": 1})
        async with engine.begin() as conn:
            with pytest.raises(LeaseLost):
                await aio.save_checkpoint(conn, job.lease, {"at": "stale"})  # old version
        small = OutboxSettings(max_checkpoint_bytes=100)
        async with engine.begin() as conn:
            with pytest.raises(CheckpointTooLarge):
                await aio.save_checkpoint(conn, fresh, {"x": "y" * 200}, settings=small)
        async with engine.begin() as conn:
            done = await aio.transition(conn, fresh, "done", evidence={"ok": True})
        async with engine.begin() as conn:
            with pytest.raises(IllegalTransition):
                await aio.save_checkpoint(conn, done, {"at": "after done"})
        async with engine.connect() as conn:
            run = await aio.get_run(conn, job.run.id)
        assert run.checkpoint == {"at": 1}
        other = OutboxSettings(schema_name="not_migrated")
        async with engine.begin() as conn:
            with pytest.raises(SchemaError):
                await aio.save_checkpoint(conn, fresh, {"at": 3}, settings=other)

    _scenario(database_url, body)
