"""A leased run's move is one named statement sent to psycopg (real PostgreSQL).

``transition`` is the end of every step a worker runs: the named query ``transition``
(outbox/db/queries.sql) as is, nothing before or after it, sync and async; short enough that
psycopg keeps its parse and, after ``prepare_threshold`` (psycopg's default, 5: outboxkit
sets none) runs on a connection, prepares it on the server. Statements are counted at the
driver (psycopg's cursors), which sees what SQLAlchemy's events miss: the async path's
statements go to psycopg directly.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import aio
from outbox.db.dsn import sqlalchemy_url
from outbox.db.queries import driver_sql
from outbox.runs import lifecycle as runs
from outbox.runs.states import RunState

NAMED = driver_sql("outbox.db", "transition", "outboxkit")


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The text of every statement psycopg's cursors execute, sync and async, in order."""
    seen: list[str] = []
    sync_execute, async_execute = psycopg.Cursor.execute, psycopg.AsyncCursor.execute

    def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(query))
        return sync_execute(self, query, *args, **kwargs)

    async def execute_async(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(query))
        return await async_execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", execute)
    monkeypatch.setattr(psycopg.AsyncCursor, "execute", execute_async)
    return seen


def _claimed(engine: Engine, count: int = 1) -> list[runs.Claim]:
    with engine.begin() as conn:
        for _ in range(count):
            runs.start_run(conn, workflow="wf", workflow_version="1",
                           idempotency_key=str(uuid.uuid4()), checkpoint={"n": 0})
    claims = []
    with engine.begin() as conn:
        for _ in range(count):
            got = runs.claim(conn, worker="w1", lease_seconds=60)
            assert got is not None
            claims.append(got)
    return claims


def test_a_move_to_done_sends_the_named_statement_once(runs_engine: Engine,
                                                       sent: list[str]) -> None:
    [claim] = _claimed(runs_engine)
    sent.clear()
    with runs_engine.begin() as conn:
        runs.transition(conn, claim.lease, RunState.DONE, evidence={"r": 1}, step="end")
    assert sent == [NAMED]
    with runs_engine.connect() as conn:
        assert runs.get_run(conn, claim.run.id).state is RunState.DONE


def test_an_async_move_inside_a_transaction_sends_the_named_statement_once(
        database_url: str, runs_engine: Engine, sent: list[str]) -> None:
    [claim] = _claimed(runs_engine)

    async def main() -> list[str]:
        engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with engine.begin() as conn:
                await aio.get_run(conn, claim.run.id)  # begins the transaction
                before = len(sent)
                await aio.transition(conn, claim.lease, RunState.WAITING,
                                     wake_at=timedelta(minutes=5), reason="later")
                return sent[before:]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [NAMED]
    with runs_engine.connect() as conn:
        run = runs.get_run(conn, claim.run.id)
    assert (run.state, run.reason) == (RunState.WAITING, "later")
    assert run.not_before is not None


def test_the_move_is_prepared_on_the_server_after_psycopgs_threshold(
        runs_engine: Engine) -> None:
    claims = _claimed(runs_engine, 6)
    with runs_engine.connect() as conn:
        for claim in claims:
            with conn.begin():
                runs.transition(conn, claim.lease, RunState.FAILED, reason="x")
        prepared = [row[0] for row in conn.exec_driver_sql(
            "SELECT statement FROM pg_prepared_statements WHERE NOT from_sql")]
    assert any("WITH moved AS" in text and "run_transitions" in text for text in prepared)
