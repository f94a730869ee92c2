"""Typed checkpoints written back through the handle, a typed start without a checkpoint, and
a worker's start-up registration (it never un-retires a workflow), on real PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine

from outbox import App, CheckpointInvalid, ClaimedRun
from outbox.aio import AsyncClaimedRun
from outbox.runs.lifecycle import get_run, list_runs, start_run
from outbox.runs.workflows import is_retired, register, retire
from tests.integration.worker_support import run_in, running


class Order(BaseModel):
    item: str
    qty: int


class TestTypedCheckpoints:
    @pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
    def test_a_step_saves_and_transitions_with_its_typed_checkpoint(
            self, engine: Engine, database_url: str, is_async: bool) -> None:
        """A pydantic model goes back as its JSON form (before: json.dumps refused it)."""
        app = App(database_url=database_url)

        if is_async:
            @app.workflow("order", version="1")
            async def bump_async(job: AsyncClaimedRun[Order]) -> None:
                order = job.checkpoint.model_copy(update={"qty": job.checkpoint.qty + 1})
                await job.save_checkpoint(order, step="bumped")
                await job.transition("waiting", step="asked", reason="r",
                                     checkpoint=order.model_copy(update={"item": "nut"}))
            fn: Any = bump_async
        else:
            @app.workflow("order", version="1")
            def bump_sync(job: ClaimedRun[Order]) -> None:
                order = job.checkpoint.model_copy(update={"qty": job.checkpoint.qty + 1})
                job.save_checkpoint(order, step="bumped")
                job.transition("waiting", step="asked", reason="r",
                               checkpoint=order.model_copy(update={"item": "nut"}))
            fn = bump_sync

        with running(app):
            with engine.begin() as conn:
                run = app.start_run(conn, fn, idempotency_key="k",
                                    checkpoint=Order(item="bolt", qty=1))
            waiting = run_in(engine, run.id, "waiting")
        assert waiting.checkpoint == {"item": "nut", "qty": 2}


class TestTypedStart:
    def test_no_checkpoint_for_a_typed_step_is_refused_and_nothing_is_queued(
            self, engine: Engine) -> None:
        app = App()

        @app.workflow("order", version="1")
        def decide(job: ClaimedRun[Order]) -> None:
            return None

        with engine.begin() as conn, pytest.raises(CheckpointInvalid,
                                                   match="not a valid Order"):
            app.start_run(conn, decide, idempotency_key="k")
        with engine.connect() as conn:
            assert list_runs(conn) == []


class TestRegistration:
    def test_starting_a_worker_leaves_an_operators_retirement_in_place(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("wf", version="1")
        def v1(job: ClaimedRun[Any]) -> None:
            return None

        with engine.begin() as conn:
            run = start_run(conn, workflow="wf", workflow_version="1", idempotency_key="a")
            register(conn, app.workflows[0])
            retire(conn, "wf", reason="operator retired it")
        with running(app, poll_seconds=0.2):
            pass
        with engine.connect() as conn:
            assert is_retired(conn, "wf")
            assert get_run(conn, run.id).state == "queued"  # never claimed

    def test_a_workflow_retired_in_code_is_recorded_retired(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("wf", version="1", retired=True, retired_reason="replaced")
        def v1(job: ClaimedRun[Any]) -> None:
            return None

        with running(app, poll_seconds=0.2):
            pass
        with engine.connect() as conn:
            assert is_retired(conn, "wf")
