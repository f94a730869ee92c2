"""A durable agent run by the worker (``App.register_agent``), beside a plain workflow, on a
real PostgreSQL: the same turns as ``outbox_agents.work``, claimed, woken and retried by the
worker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import App, ClaimedRun
from outbox.errors import ConfigurationError
from outbox.runs.retry import RetryPolicy
from outbox.settings import OutboxSettings
from outbox_agents import effect_message_id
from tests.integration.agents_support import Script, drive, outbox_rows, support_agent
from tests.integration.worker_support import run_in, running, wait_for

T = TypeVar("T")
FAST_RETRY = RetryPolicy(initial_backoff=0.01, max_backoff=0.01, jitter=0)


def test_the_worker_drives_an_agent_to_its_effect_and_on_to_its_answer(
        engine: Engine, database_url: str) -> None:
    script = Script()
    durable = support_agent(script, lease_seconds=5)
    app = App(database_url=database_url)
    app.register_agent(durable.agent)
    plain: list[uuid.UUID] = []

    @app.workflow("plain", version="1")
    def step(job: ClaimedRun[Any]) -> None:
        plain.append(job.run.id)

    with running(app):
        run = on_loop(database_url, lambda e: _start(e, durable, "Order A1 is late", "t-1"))
        with engine.begin() as conn:
            other = app.start_run(conn, step, idempotency_key="p-1")
        waiting = run_in(engine, run.id, "waiting")
        [row] = on_loop(database_url, outbox_rows)
        call_id = waiting.checkpoint["calls"][0]["call_id"]
        assert row.message_id == effect_message_id(run.id, call_id)
        with engine.begin() as conn:  # the supplier's answer, as ctx.confirm records it
            app.confirm(conn, run_id=run.id, confirmation_id=str(row.message_id),
                        outcome="running", evidence={"reference": "S-77"}, actor="test")
        done = run_in(engine, run.id, "done")
        run_in(engine, other.id, "done")
    assert done.checkpoint["output"] == "reordered: {'reference': 'S-77'}"
    assert len(script.requests) == 3  # lookup, reorder, answer: none asked twice
    assert len(on_loop(database_url, outbox_rows)) == 1
    assert plain == [other.id]


def test_a_turn_holds_the_agents_lease_not_the_workers(
        engine: Engine, database_url: str) -> None:
    """The worker claims with its 60 s lease; the agent's 5 s is what a killed worker's run
    waits for, as with outbox_agents.work."""
    hold = asyncio.Event()
    script = Script(hold=hold)
    durable = support_agent(script, lease_seconds=5)
    app = App(database_url=database_url)
    app.register_agent(durable.agent)
    with running(app, lease_seconds=60) as worker:
        run = on_loop(database_url, lambda e: _start(e, durable, "Order A1 is late", "t-1"))
        wait_for(lambda: script.requests, what="the model to be asked")
        with engine.connect() as conn:
            left = conn.execute(text(
                "SELECT extract(epoch FROM lease_expires_at - now()) "
                "FROM outboxkit.agent_runs WHERE id = :id"), {"id": run.id}).scalar_one()
        assert worker._loop is not None
        worker._loop.call_soon_threadsafe(hold.set)  # the model answers
        run_in(engine, run.id, "waiting")
    assert 0 < float(left) <= 5


def test_a_failing_model_call_is_retried_by_the_agents_policy(
        engine: Engine, database_url: str) -> None:
    script = Script(fail_at=1)
    durable = support_agent(script, retry=FAST_RETRY)
    app = App(database_url=database_url)
    app.register_agent(durable.agent)
    with running(app):
        run = on_loop(database_url, lambda e: _start(e, durable, "Order A1 is late", "t-1"))
        waiting = run_in(engine, run.id, "waiting")
    assert waiting.attempts == 1
    assert len(script.requests) == 3  # the failed one, then lookup and reorder


def test_an_agent_registered_twice_is_refused_naming_its_workflow(database_url: str) -> None:
    durable = support_agent(Script())
    app = App(database_url=database_url)
    app.register_agent(durable.agent)
    with pytest.raises(ConfigurationError, match=r"workflow 'support' version .* twice"):
        app.register_agent(durable.agent)


def test_an_agents_runs_are_started_by_the_agent_not_start_run(
        engine: Engine, database_url: str) -> None:
    durable = support_agent(Script())
    app = App(database_url=database_url)
    app.register_agent(durable.agent)
    with engine.begin() as conn, pytest.raises(
            ConfigurationError, match=r"'support' is a registered agent: start its runs"):
        app.start_run(conn, "support", idempotency_key="k")


def test_an_agent_writing_to_another_schema_is_refused(database_url: str) -> None:
    durable = support_agent(Script(), settings=OutboxSettings(schema_name="elsewhere"))
    app = App(database_url=database_url)
    with pytest.raises(ConfigurationError, match="schema 'elsewhere' but this app's worker"):
        app.register_agent(durable.agent)


def on_loop(database_url: str, scenario: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    return drive(database_url, scenario)


async def _start(engine: AsyncEngine, durable: Any, prompt: str, key: str) -> Any:
    async with engine.begin() as conn:
        return await durable.start(conn, prompt, key=key)
