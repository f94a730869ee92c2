"""A run's append-only log, written with its fenced checkpoint (real PostgreSQL, sync and
async twins), and dropped or archived by retention."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import aio
from outbox.db.dsn import sqlalchemy_url
from outbox.errors import CheckpointTooLarge, ConfigurationError, LeaseLost
from outbox.handle import claim
from outbox.runs.lifecycle import get_run, save_checkpoint, start_run
from outbox.runs.retention import purge_batch
from outbox.runs.runlog import read_log
from outbox.settings import OutboxSettings


def _claimed(engine: Engine, key: str = "k") -> Any:
    with engine.begin() as conn:
        start_run(conn, workflow="wf", workflow_version="1", idempotency_key=key)
    with engine.begin() as conn:
        job = claim(conn, worker="w", lease_seconds=60)
        assert job is not None
    return job


def test_entries_go_in_with_the_checkpoint_and_a_stale_lease_adds_none(engine: Engine) -> None:
    job = _claimed(engine)
    with engine.begin() as conn:
        handle = job.on(conn)
        handle.save_checkpoint({"logged": 2}, log={0: {"m": "hello"}, 1: {"m": "draft"}})
    with engine.begin() as conn:
        # The newest entry may be written again; the next one is added.
        handle = handle.on(conn)
        handle.save_checkpoint({"logged": 3}, log={1: {"m": "sent"}, 2: {"m": "answer"}})
    with engine.begin() as conn, pytest.raises(LeaseLost):
        job.on(conn).save_checkpoint({"logged": 4}, log={3: {"m": "stale"}})  # old version
    with engine.connect() as conn:
        assert read_log(conn, job.run.id) == [{"m": "hello"}, {"m": "sent"}, {"m": "answer"}]
        assert read_log(conn, job.run.id, upto=2) == [{"m": "hello"}, {"m": "sent"}]


def test_bad_entries_are_refused_before_anything_is_sent(engine: Engine) -> None:
    job = _claimed(engine)
    small = OutboxSettings(max_checkpoint_bytes=50)
    with engine.begin() as conn:
        with pytest.raises(CheckpointTooLarge):
            save_checkpoint(conn, job.lease, {"n": 1}, log={0: "x" * 100}, settings=small)
        with pytest.raises(ConfigurationError, match="sequence number"):
            save_checkpoint(conn, job.lease, {"n": 1}, log={-1: "x"})
        with pytest.raises(ConfigurationError, match="None"):
            save_checkpoint(conn, job.lease, {"n": 1}, log={0: None})
    with engine.connect() as conn:
        assert read_log(conn, job.run.id) == []
        assert get_run(conn, job.run.id).checkpoint is None


def test_the_async_twin_writes_the_same_log_in_its_one_statement(database_url: str,
                                                                 engine: Engine) -> None:
    job = _claimed(engine)

    async def main() -> None:
        async_engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with async_engine.begin() as conn:
                lease = await aio.save_checkpoint(conn, job.lease, {"logged": 2},
                                                  log={0: ["a"], 1: {"b": "é"}})
                lease = await aio.save_checkpoint(conn, lease, {"logged": 2})  # no entries
            async with async_engine.begin() as conn:
                with pytest.raises(LeaseLost):
                    await aio.save_checkpoint(conn, job.lease, {}, log={2: "stale"})
            async with async_engine.connect() as conn:
                assert await aio.read_log(conn, job.run.id) == [["a"], {"b": "é"}]
                assert await aio.read_log(conn, job.run.id, upto=1) == [["a"]]
            assert lease.version == job.lease.version + 2
        finally:
            await async_engine.dispose()

    asyncio.run(main())


@pytest.mark.parametrize("archive", [False, True])
def test_retention_drops_a_purged_runs_log_and_archives_it_in_order(
        engine: Engine, archive: bool) -> None:
    job = _claimed(engine)
    with engine.begin() as conn:
        handle = job.on(conn)
        handle.save_checkpoint({"logged": 2}, log={1: "second", 0: "first"})
        handle.transition("done", evidence={"ok": True})
    with engine.begin() as conn:
        assert purge_batch(conn, older_than=timedelta(0), archive=archive) == 1
    with engine.connect() as conn:
        assert read_log(conn, job.run.id) == []
        archived = conn.execute(text("SELECT log FROM outboxkit.run_archive WHERE run_id = :r"),
                                {"r": job.run.id}).scalar_one_or_none()
    assert archived == (["first", "second"] if archive else None)
