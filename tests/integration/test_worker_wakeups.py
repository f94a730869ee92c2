"""The runs' wake-ups against real PostgreSQL: each one (start, wake, requeue, confirmation,
retry) wakes an idle worker at once; a commit NOTIFYs only while some worker waits; and with
``notify=False`` each can be PREPAREd (two-phase commit)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox import App, ClaimedRun, RetryPolicy, aio
from outbox.db.dsn import sqlalchemy_url
from outbox.handle import claim
from outbox.runs.approvals import grant, request_approval
from outbox.runs.confirm import apply_confirmation
from outbox.runs.lifecycle import move, start_run, transition, wake
from outbox.runs.retry import handle_failure
from outbox.runs.wakeups import channel, declare_idle
from outbox.settings import OutboxSettings
from tests.integration.worker_support import run_in, running, wait_for

CHANNEL = channel(OutboxSettings())


def _waiting_run(engine: Engine, key: str, workflow: str = "wf") -> Any:
    """A run claimed by someone else and moved to waiting for an hour."""
    with engine.begin() as conn:
        start_run(conn, workflow=workflow, workflow_version="1", idempotency_key=key)
        job = claim(conn, worker="elsewhere", lease_seconds=60)
        assert job is not None
        job.transition("waiting", step="asked", reason="waiting for a reply",
                       wake_at=timedelta(hours=1))
    return job.run


def _failed_run(engine: Engine, key: str) -> Any:
    with engine.begin() as conn:
        run = start_run(conn, workflow="wf", workflow_version="1", idempotency_key=key)
        job = claim(conn, worker="elsewhere", lease_seconds=60)
        assert job is not None
        job.transition("failed", reason="gave up")
    return run


def _wake(engine: Engine) -> Any:
    run = _waiting_run(engine, "wake")
    with engine.begin() as conn:
        wake(conn, run.id)
    return run


def _requeue(engine: Engine) -> Any:
    run = _failed_run(engine, "move")
    with engine.begin() as conn:
        move(conn, run.id, "queued", actor="operator", reason="try again")
    return run


def _confirm(engine: Engine) -> Any:
    run = _waiting_run(engine, "confirm")
    with engine.begin() as conn:
        apply_confirmation(conn, run_id=run.id, confirmation_id="c-1", outcome="running",
                           evidence={"status": "accepted"}, actor="consumer")
    return run


def _retry(engine: Engine) -> Any:
    """A requeue by another process's retry policy (the worker did not run this step, so
    nothing but the NOTIFY tells it)."""
    with engine.begin() as conn:
        start_run(conn, workflow="wf", workflow_version="1", idempotency_key="retry")
        job = claim(conn, worker="elsewhere", lease_seconds=60)
        assert job is not None
    with engine.begin() as conn:
        job.on(conn).handle_failure(RuntimeError("flaky"), policy=RetryPolicy(
            max_attempts=3, initial_backoff=0.001, jitter=0))
    return job.run


def _grant(engine: Engine) -> Any:
    """A person grants the approval the run waits for (outbox approvals grant, the console)."""
    run = _waiting_run(engine, "grant")
    with engine.begin() as conn:
        approval = request_approval(conn, run.id, scope={"tool": "refund"},
                                    expires_at=timedelta(hours=1))
    with engine.begin() as conn:
        grant(conn, approval.id, by="ann")
    return run


class TestEachWakeUpWakesAnIdleWorker:
    @pytest.mark.parametrize("change", [_wake, _requeue, _confirm, _retry, _grant],
                             ids=["wake", "move-to-queued", "confirmation", "retry-requeue",
                                  "approval-granted"])
    def test_it_reaches_the_step_at_once_with_a_30_s_poll(
            self, engine: Engine, database_url: str,
            change: Callable[[Engine], Any]) -> None:
        app = App(database_url=database_url)
        stepped: list[float] = []

        @app.workflow("wf", version="1")
        def step(job: ClaimedRun[Any]) -> None:
            stepped.append(time.monotonic())

        with running(app, poll_seconds=30) as worker:
            wait_for(lambda: worker._idle, what="the worker to declare itself idle")
            started = time.monotonic()
            run = change(engine)
            run_in(engine, run.id, "done", timeout=5)
        assert stepped, "the step never ran"
        assert stepped[0] - started < 2.0


@pytest.fixture
def listener(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


def heard(conn: psycopg.Connection[Any], timeout: float = 0.3) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=timeout, stop_after=1)]


class TestNotifyOnlyWhileAWorkerWaits:
    def test_no_worker_waiting_means_no_notify(self, engine: Engine, listener: Any) -> None:
        """A busy system (or none running) does not pay NOTIFY's commit lock."""
        with engine.begin() as conn:
            start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        assert heard(listener) == []

    def test_a_waiting_worker_is_notified_at_commit(self, engine: Engine,
                                                    listener: Any) -> None:
        with engine.begin() as conn:
            conn.execute(declare_idle("w-1", 60))
        with engine.begin() as conn:
            start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        assert heard(listener, timeout=2) == ["wf"]

    def test_an_expired_declaration_is_not_waited_for(self, engine: Engine,
                                                      listener: Any) -> None:
        """A worker killed while idle stops costing commits at its idle_until."""
        with engine.begin() as conn:
            conn.execute(declare_idle("w-dead", 0.001))
        time.sleep(0.01)
        with engine.begin() as conn:
            start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        assert heard(listener) == []

    def test_a_worker_withdraws_its_declaration_when_it_stops(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("wf", version="1")
        def step(job: ClaimedRun[Any]) -> None:
            return None

        with running(app, name="w-stops") as worker:
            wait_for(lambda: worker._idle, what="the worker to declare itself idle")
            assert _declared(engine) == ["w-stops"]
        assert _declared(engine) == []


def _declared(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT worker FROM outboxkit.run_workers "
                                      "WHERE idle_until > now()")).scalars())


# --- two-phase commit: with notify=False each wake-up can be prepared ----------------------


@pytest.fixture
def gid(engine: Engine) -> Iterator[str]:
    """A prepared transaction's global id, rolled back if the test left it prepared."""
    with engine.connect() as conn:
        allowed = int(conn.exec_driver_sql("SHOW max_prepared_transactions").scalar_one())
    assert allowed > 0, "this server refuses PREPARE TRANSACTION (max_prepared_transactions=0)"
    name = f"outboxkit-test-{uuid.uuid4().hex}"
    try:
        yield name
    finally:
        with engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            if auto.execute(text("SELECT 1 FROM pg_prepared_xacts WHERE gid = :g"),
                            {"g": name}).first() is not None:
                auto.exec_driver_sql(f"ROLLBACK PREPARED '{name}'")


def _prepared_writes(engine: Engine) -> dict[str, Callable[[Connection, bool], object]]:
    """Each wake-up, on a run set up for it, as a write taking *notify*."""
    waiting = _waiting_run(engine, "2pc-wake")
    confirmed = _waiting_run(engine, "2pc-confirm")
    failed = _failed_run(engine, "2pc-move")
    app = App()

    @app.workflow("typed", version="1")
    def typed(job: ClaimedRun[Any]) -> None:
        return None

    with engine.begin() as conn:
        start_run(conn, workflow="wf", workflow_version="1", idempotency_key="2pc-retry")
        job = claim(conn, worker="w", lease_seconds=60)
    assert job is not None
    return {
        "start_run": lambda c, n: start_run(c, workflow="wf", workflow_version="1",
                                            idempotency_key="2pc-start", notify=n),
        "app.start_run": lambda c, n: app.start_run(c, typed, idempotency_key="2pc-app",
                                                    notify=n),
        "wake": lambda c, n: wake(c, waiting.id, notify=n),
        "move": lambda c, n: move(c, failed.id, "queued", actor="op", notify=n),
        "apply_confirmation": lambda c, n: apply_confirmation(
            c, run_id=confirmed.id, confirmation_id="c", outcome="running",
            evidence={"ok": True}, actor="consumer", notify=n),
        "handle_failure": lambda c, n: handle_failure(
            c, job.lease, RuntimeError("x"), policy=RetryPolicy(), notify=n),
        "job.handle_failure": lambda c, n: job.on(c).handle_failure(
            RuntimeError("x"), policy=RetryPolicy(), notify=n),
    }


WRITES = ["start_run", "app.start_run", "wake", "move", "apply_confirmation",
          "handle_failure", "job.handle_failure"]


class TestTwoPhaseCommit:
    @pytest.mark.parametrize("name", WRITES)
    def test_with_notify_false_it_prepares_even_while_a_worker_waits(
            self, engine: Engine, listener: Any, gid: str, name: str) -> None:
        write = _prepared_writes(engine)[name]
        with engine.begin() as conn:
            conn.execute(declare_idle("w-1", 60))
        with engine.connect() as conn:
            prepared = conn.begin_twophase(gid)
            write(conn, False)
            prepared.prepare()
            prepared.commit()
        assert heard(listener) == []

    @pytest.mark.parametrize("name", ["wake", "move"])
    def test_by_default_a_waiting_worker_makes_prepare_fail(
            self, engine: Engine, gid: str, name: str) -> None:
        """Why notify=False exists: the default NOTIFYs while a worker waits."""
        write = _prepared_writes(engine)[name]
        with engine.begin() as conn:
            conn.execute(declare_idle("w-1", 60))
        with engine.connect() as conn:
            conn.begin()
            write(conn, True)
            with pytest.raises(Exception, match="cannot PREPARE a transaction that has "
                                                "executed LISTEN, UNLISTEN, or NOTIFY"):
                conn.exec_driver_sql(f"PREPARE TRANSACTION '{gid}'")
            conn.rollback()

    def test_the_async_twins_take_notify_false_too(
            self, engine: Engine, database_url: str, listener: Any) -> None:
        waiting = _waiting_run(engine, "a-wake")
        failed = _failed_run(engine, "a-move")
        confirmed = _waiting_run(engine, "a-confirm")
        with engine.begin() as conn:
            conn.execute(declare_idle("w-1", 60))
        app = App()

        @app.workflow("wf", version="1")
        def step(job: ClaimedRun[Any]) -> None:
            return None

        async def go() -> None:
            async_engine = create_async_engine(sqlalchemy_url(database_url))
            try:
                await steps(async_engine)
            finally:
                await async_engine.dispose()  # in this loop: no connection left to the GC

        async def steps(async_engine: AsyncEngine) -> None:
            async with async_engine.begin() as conn:
                await aio.wake(conn, waiting.id, notify=False)
                await aio.move(conn, failed.id, "queued", actor="op", notify=False)
                await aio.apply_confirmation(conn, run_id=confirmed.id, confirmation_id="c",
                                             outcome="running", evidence={"ok": 1},
                                             actor="consumer", notify=False)
                await app.start_run_async(conn, step, idempotency_key="a-start", notify=False)
                await aio.start_run(conn, workflow="wf", workflow_version="1",
                                    idempotency_key="a-start-2", notify=False)
            async with async_engine.begin() as conn:
                job = await aio.claim(conn, worker="w", lease_seconds=60)
                assert job is not None
            async with async_engine.begin() as conn:
                await job.on(conn).handle_failure(RuntimeError("x"), policy=RetryPolicy(
                    initial_backoff=0.001), notify=False)

        asyncio.run(go())
        assert heard(listener) == []


def test_transition_keeps_no_notify(engine: Engine, listener: Any) -> None:
    """Only the wake-ups notify: a worker's own moves (waiting, done) never do."""
    with engine.begin() as conn:
        conn.execute(declare_idle("w-1", 60))
        start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k", notify=False)
        got = claim(conn, worker="w", lease_seconds=60)
        assert got is not None
        transition(conn, got.lease, "waiting", reason="wait", wake_at=timedelta(hours=1))
    assert heard(listener) == []


def test_a_listener_that_connects_after_the_loop_went_idle_still_gets_it_woken(
        engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop declares itself idle (so commits NOTIFY) only while LISTENing: a LISTEN
    connection slower than the first empty claim must wake the loop to declare it, or a
    started run waits for the fallback poll (30 s here)."""
    from outbox.worker import wakeup  # noqa: PLC0415

    listen = wakeup.Listener.run

    async def late(self: Any) -> None:
        await asyncio.sleep(1.5)  # the loop's first empty claim comes first
        await listen(self)

    monkeypatch.setattr(wakeup.Listener, "run", late)
    app = App(database_url=database_url)

    @app.workflow("wf", version="1")
    def step(job: ClaimedRun[Any]) -> None:
        return None

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, step, idempotency_key="k")
        run_in(engine, run.id, "done", timeout=5)


def test_a_run_started_before_the_worker_went_idle_and_committed_after_is_claimed_at_once(
        engine: Engine, database_url: str) -> None:
    """The start's statement read the declarations before the worker's said "idle" (so it
    will not NOTIFY), and its transaction commits after the worker's claim once more: the
    worker must not take that claim until the transaction ended, or the run waits for the
    fallback poll (30 s here)."""
    app = App(database_url=database_url)

    @app.workflow("wf", version="1")
    def step(job: ClaimedRun[Any]) -> None:
        return None

    with engine.connect() as open_start:
        opened = open_start.begin()
        run = app.start_run(open_start, step, idempotency_key="late")
        with running(app):
            with engine.connect() as conn:
                wait_for(lambda: conn.execute(text(
                    "SELECT count(*) FROM outboxkit.run_workers WHERE idle_until > now()"
                )).scalar(), what="the worker to declare itself idle")
            time.sleep(0.5)  # its claim once more would be over by now
            opened.commit()
            run_in(engine, run.id, "done", timeout=5)
