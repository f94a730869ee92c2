"""Named signals (outbox/runs/signals.py) against real PostgreSQL: sent once per id, kept
until the run takes them, waking a run that waits for them, refused for finished runs and
for names a workflow does not declare; and a workflow on the worker that waits for one."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from outbox import App, ClaimedRun, RunState
from outbox.errors import ConfigurationError, IllegalTransition, LeaseLost, RunNotFound
from outbox.runs import lifecycle
from tests.integration.worker_support import run_in, running


def _app(database_url: str) -> tuple[App, Any]:
    app = App(database_url=database_url)

    @app.workflow("order", version="1", signals=["paid", "cancel"])
    def order(job: ClaimedRun[Any]) -> None:
        return None

    return app, order


def _claimed(engine: Engine, app: App, order: Any, key: str = "o-1") -> tuple[Any, Any]:
    with engine.begin() as conn:
        run = app.start_run(conn, order, idempotency_key=key)
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=60)
    assert job is not None
    assert job.run.id == run.id
    return run, job


def _state(engine: Engine, run_id: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT state, not_before <= now() AS due, awaits_signals "
            "FROM outboxkit.agent_runs WHERE id = :id"), {"id": run_id}).one()


def test_a_signal_wakes_the_run_that_waits_for_it_and_is_taken_once(
        engine: Engine, database_url: str) -> None:
    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)
    with engine.begin() as conn:
        job.on(conn).wait_for_signal("paid", until=timedelta(hours=1), step="awaiting-payment")
    waiting = _state(engine, run.id)
    assert (waiting.state, waiting.due, waiting.awaits_signals) == ("waiting", False, ["paid"])
    with engine.begin() as conn:
        assert app.signal(conn, run.id, "paid", signal_id="pay-1", payload={"amount": 12},
                          sender="payments") is True
    with engine.begin() as conn:  # the same signal again (a retried webhook): nothing more
        assert app.signal(conn, run.id, "paid", signal_id="pay-1", payload={"amount": 12},
                          sender="payments") is False
    woken = _state(engine, run.id)
    assert (woken.state, woken.due) == ("waiting", True)
    with engine.begin() as conn:
        again = app.claim(conn, worker="w2", lease_seconds=60)
    assert again is not None
    assert again.run.id == run.id
    with engine.begin() as conn:
        handle = again.on(conn)
        got = handle.receive("paid")
        assert got is not None
        assert (got.name, got.payload, got.sender, got.signal_id) == (
            "paid", {"amount": 12}, "payments", "pay-1")
        assert handle.receive("paid") is None  # taken: one signal, one receive
    assert _state(engine, run.id).awaits_signals is None  # the claim cleared the wait


def test_a_signal_sent_before_the_wait_is_kept_and_the_wait_does_not_wait(
        engine: Engine, database_url: str) -> None:
    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)
    with engine.begin() as conn:  # the run is running: kept, nobody woken
        assert app.signal(conn, run.id, "cancel", signal_id="c-1", sender="customer")
    with engine.begin() as conn:
        job.on(conn).wait_for_signal("paid", "cancel", until=timedelta(hours=1))
    state = _state(engine, run.id)
    assert (state.state, state.due) == ("waiting", True)  # claimable at once


def test_a_receive_rolled_back_leaves_the_signal_for_the_next_attempt(
        engine: Engine, database_url: str) -> None:
    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)
    with engine.begin() as conn:
        app.signal(conn, run.id, "paid", signal_id="pay-1", sender="payments")
    with engine.connect() as conn:
        with conn.begin() as tx:
            assert job.on(conn).receive("paid") is not None
            tx.rollback()
        with conn.begin():
            assert job.on(conn).receive("paid") is not None


def test_a_stale_lease_takes_no_signal(engine: Engine, database_url: str) -> None:
    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)
    with engine.begin() as conn:
        app.signal(conn, run.id, "paid", signal_id="pay-1", sender="payments")
        conn.execute(text("UPDATE outboxkit.agent_runs SET lease_token = lease_token + 1 "
                          "WHERE id = :id"), {"id": run.id})
    with engine.begin() as conn, pytest.raises(LeaseLost):
        job.on(conn).receive("paid")
    with engine.connect() as conn:
        pending = conn.execute(text("SELECT count(*) FROM outboxkit.run_signals "
                                    "WHERE received_at IS NULL")).scalar_one()
    assert pending == 1


class TestRefused:
    def test_a_finished_run_refuses_a_signal_and_nothing_is_written(
            self, engine: Engine, database_url: str) -> None:
        app, order = _app(database_url)
        run, job = _claimed(engine, app, order)
        with engine.begin() as conn:
            job.on(conn).transition(RunState.DONE, reason="done", evidence={"ok": True})
        with engine.begin() as conn, pytest.raises(IllegalTransition, match="finished run"):
            app.signal(conn, run.id, "paid", signal_id="late", sender="payments")
        assert _count(engine) == 0

    def test_a_name_the_workflow_does_not_declare_is_refused(
            self, engine: Engine, database_url: str) -> None:
        app, order = _app(database_url)
        run, _ = _claimed(engine, app, order)
        with engine.begin() as conn, pytest.raises(
                ConfigurationError, match=r"takes no signal 'refund' \(it declares: cancel, paid"):
            app.signal(conn, run.id, "refund", signal_id="r-1", sender="ops")
        assert _count(engine) == 0

    def test_a_signal_id_reused_for_another_signal_is_refused(
            self, engine: Engine, database_url: str) -> None:
        app, order = _app(database_url)
        run, _ = _claimed(engine, app, order)
        with engine.begin() as conn:
            app.signal(conn, run.id, "paid", signal_id="s-1", payload=1, sender="payments")
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="names one signal"):
            app.signal(conn, run.id, "paid", signal_id="s-1", payload=2, sender="payments")

    @pytest.mark.parametrize("name", ["", "has space", "-dash-first", "x" * 129, None])
    def test_a_bad_name_is_refused_before_anything_is_sent(
            self, engine: Engine, database_url: str, name: Any) -> None:
        app, order = _app(database_url)
        run, _ = _claimed(engine, app, order)
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="signal name"):
            app.signal(conn, run.id, name, signal_id="s", sender="x")

    def test_an_unknown_run_is_named(self, engine: Engine, database_url: str) -> None:
        import uuid  # noqa: PLC0415

        app, _ = _app(database_url)
        with engine.begin() as conn, pytest.raises(RunNotFound):
            app.signal(conn, uuid.uuid4(), "paid", signal_id="s", sender="x")


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outboxkit.run_signals")).scalar_one())


def test_a_workflow_on_the_worker_waits_for_its_signal_and_goes_on_with_it(
        engine: Engine, database_url: str) -> None:
    """The shape docs/workflows.md shows: take the signal if it is there, else wait for it."""
    app = App(database_url=database_url)
    seen: list[Any] = []
    stepped = threading.Event()

    @app.workflow("checkout", version="1", signals=["paid"])
    def checkout(job: ClaimedRun[Any]) -> None:
        stepped.set()
        paid = job.receive("paid")
        if paid is None:
            job.wait_for_signal("paid", until=timedelta(minutes=30), step="awaiting-payment")
            return
        seen.append(paid.payload)

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, checkout, idempotency_key="cart-1")
        waiting = run_in(engine, run.id, "waiting")
        assert waiting.step == "awaiting-payment"
        with engine.begin() as conn:
            app.signal(conn, run.id, "paid", signal_id="pay-9", payload={"ref": "P9"},
                       sender="payments")
        run_in(engine, run.id, "done")
    assert seen == [{"ref": "P9"}]
    with engine.connect() as conn:
        reasons = [t.reason for t in lifecycle.history(conn, run.id)]
    assert "waits for signal paid" in reasons


def test_retention_deletes_a_purged_runs_signals(engine: Engine, database_url: str) -> None:
    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)
    with engine.begin() as conn:
        app.signal(conn, run.id, "paid", signal_id="pay-1", payload={"card": "4242"},
                   sender="payments")
    with engine.begin() as conn:
        job.on(conn).transition(RunState.DONE, reason="done", evidence={"ok": True})
    assert _count(engine) == 1
    assert app.purge(engine, older_than=timedelta(0)) == 1
    assert _count(engine) == 0


def test_the_async_twins_send_wait_and_take_the_same_way(
        engine: Engine, database_url: str) -> None:
    import asyncio  # noqa: PLC0415

    from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415

    from outbox.db.dsn import sqlalchemy_url  # noqa: PLC0415

    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)

    async def scenario() -> Any:
        aengine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with aengine.begin() as conn:
                ajob = await app.claim_async(conn, worker="w", lease_seconds=60)
            assert ajob is None  # the sync claim above holds it
            from outbox.aio import AsyncClaimedRun  # noqa: PLC0415

            async with aengine.begin() as conn:
                handle = AsyncClaimedRun(conn, job.run, job.lease)
                await handle.wait_for_signal("paid", until=timedelta(hours=1))
            async with aengine.begin() as conn:
                assert await app.signal_async(conn, run.id, "paid", signal_id="a-1",
                                              payload=[1, 2], sender="async")
            async with aengine.begin() as conn:
                again = await app.claim_async(conn, worker="w2", lease_seconds=60)
                assert again is not None
            async with aengine.begin() as conn:
                return await again.on(conn).receive("paid")
        finally:
            await aengine.dispose()

    got = asyncio.run(scenario())
    assert (got.name, got.payload, got.sender) == ("paid", [1, 2], "async")


def test_a_signal_sent_while_the_wait_commits_waits_for_it_and_wakes_the_run(
        engine: Engine, database_url: str) -> None:
    """The send blocks on the run's row, locked by the wait, and finds the run waiting for it
    once the step commits: no signal falls between the step's look and its wait."""
    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)
    sent: list[bool] = []
    with engine.connect() as conn, conn.begin():
        handle = job.on(conn)
        assert handle.receive("paid") is None
        handle.wait_for_signal("paid", until=timedelta(hours=1))

        def send() -> None:
            with engine.begin() as other:
                sent.append(app.signal(other, run.id, "paid", signal_id="p", sender="x"))

        sender = threading.Thread(target=send)
        sender.start()
        sender.join(0.5)
        assert sender.is_alive()  # waiting for the step's row lock
    sender.join(10)
    assert sent == [True]
    state = _state(engine, run.id)
    assert (state.state, state.due) == ("waiting", True)


def test_a_run_moved_out_of_its_wait_and_back_does_not_take_the_old_names(
        engine: Engine, database_url: str) -> None:
    """waiting (for 'paid') -> needs-human -> waiting (for the ledger, say): a 'paid' signal
    is kept, and wakes nothing."""
    app, order = _app(database_url)
    run, job = _claimed(engine, app, order)
    with engine.begin() as conn:
        job.on(conn).wait_for_signal("paid")
    with engine.begin() as conn:
        app.move(conn, run.id, RunState.NEEDS_HUMAN, actor="ops", reason="look")
        app.move(conn, run.id, RunState.WAITING, actor="ops", reason="waits for the ledger")
    assert _state(engine, run.id).awaits_signals is None
    with engine.begin() as conn:
        assert app.signal(conn, run.id, "paid", signal_id="p", sender="payments")
    assert (_state(engine, run.id).state, _state(engine, run.id).due) == ("waiting", None)


def test_a_retried_send_is_the_same_signal_whatever_the_json_spelling(
        engine: Engine, database_url: str) -> None:
    app, order = _app(database_url)
    run, _ = _claimed(engine, app, order)
    with engine.begin() as conn:
        assert app.signal(conn, run.id, "paid", signal_id="s", sender="x",
                          payload={"items": (1, 2), "b": 1.0, "a": None})
    with engine.begin() as conn:
        assert not app.signal(conn, run.id, "paid", signal_id="s", sender="x",
                              payload={"a": None, "b": 1.0, "items": [1, 2]})


def test_each_version_declares_its_own_signals(engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    @app.workflow("ship", version="1", signals=["paid", "cancel"])
    def v1(job: ClaimedRun[Any]) -> None:
        return None

    @app.workflow("ship", version="2", signals=["paid"])
    def v2(job: ClaimedRun[Any]) -> None:
        return None

    with engine.begin() as conn:
        old = app.start_run(conn, v1, idempotency_key="old")
        new = app.start_run(conn, v2, idempotency_key="new")
    with engine.begin() as conn:
        assert app.signal(conn, old.id, "cancel", signal_id="c", sender="x")
    with engine.begin() as conn, pytest.raises(ConfigurationError,
                                               match="version '2' takes no signal 'cancel'"):
        app.signal(conn, new.id, "cancel", signal_id="c", sender="x")


def test_the_cli_refuses_a_payload_postgresql_cannot_store(
        engine: Engine, database_url: str) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from outbox.cli.main import main  # noqa: PLC0415

    app, order = _app(database_url)
    run, _ = _claimed(engine, app, order)
    result = CliRunner().invoke(main, ["runs", "signal", str(run.id), "paid", "--id", "s",
                                       "--payload", "NaN", "--sender", "ops",
                                       "--database-url", database_url])
    assert result.exit_code == 2, result.output
    assert "NaN is not a JSON value" in result.output
    assert _count(engine) == 0
