"""Compensation's edges, one turn at a time as the worker takes them (real PostgreSQL): a
compensating run is never failed from outside (a cancel leaves it to its undoing), a
confirmation that reaches it between turns is kept, an operation recorded without the run's
id still tells the outcome, a retired workflow's run still undoes, an outcome unknown too
long goes to a person who may keep the effect, and the asyncio handle does what the sync
one does."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import create_async_engine

from dedup.ledger import Applied, Evidence, Ledger
from outbox import App, ClaimedRun, Envelope
from outbox.aio import AsyncClaimedRun
from outbox.db.dsn import sqlalchemy_url
from outbox.db.execution import run_plan
from outbox.errors import ConfigurationError, IllegalTransition, RunError
from outbox.messages import compensations
from outbox.runs.compensation import compensation_id
from outbox.runs.workflows import register


def effect(kind: str) -> Envelope:
    return Envelope(topic="shop", type=kind, key="o-1", payload={"order": "o-1"})


def started(engine: Engine, app: App) -> tuple[uuid.UUID, uuid.UUID]:
    """A run that emitted one effect (with its undo) and waits for its outcome."""

    @app.workflow("w", version="1")
    def w(job: ClaimedRun[Any]) -> None:  # the tests take the turns by hand
        raise AssertionError("not run")

    with engine.begin() as conn:
        register(conn, app.step("w").workflow)
        run = app.start_run(conn, "w", idempotency_key="k")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w1", lease_seconds=30)
        assert job is not None
        sent = job.emit(effect("reserve"), compensation=effect("release"))
        job.transition("waiting", step="reserve", reason="sent")
    return run.id, sent


def turn(engine: Engine, app: App) -> None:
    """One compensation turn, as the worker takes it."""
    with engine.begin() as conn:
        job = app.claim(conn, worker="w2", lease_seconds=30)
    assert job is not None
    assert job.run.compensating_since is not None
    with engine.begin() as conn:
        run_plan(conn, compensations.step_plan(job.lease, actor="w2", settings=None))


def row(engine: Engine, run_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT state, reason, compensating_since IS NOT NULL AS compensating, "
            "(SELECT array_agg(state ORDER BY seq) FROM outboxkit.run_effects e "
            " WHERE e.run_id = r.id) AS effects FROM outboxkit.agent_runs r WHERE id = :r"),
            {"r": run_id}).one()


def test_a_compensating_run_is_never_failed_or_cancelled_from_outside(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    run_id, sent = started(engine, app)
    with engine.begin() as conn:
        app.confirm(conn, run_id=run_id, confirmation_id=sent, outcome="running",
                    evidence={"ref": "R-1"}, actor="stock")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w1", lease_seconds=30)
        assert job is not None
        job.transition("failed", reason="payment declined")  # with an effect: compensates
    turn(engine, app)  # sends the release, waits for its outcome
    before = row(engine, run_id)
    assert (before.state, before.effects) == ("waiting", ["compensating"])
    with engine.begin() as conn, pytest.raises(IllegalTransition, match="compensating"):
        app.move(conn, run_id, "failed", actor="ops", reason="give up")
    with engine.begin() as conn:  # a cancel leaves it to its undoing, and says so
        cancelled = app.cancel(conn, run_id, actor="ops")
    assert (cancelled.moved, cancelled.compensating) == ([], [run_id])
    assert row(engine, run_id) == before


def test_a_confirmation_between_turns_is_kept_for_the_next_turn(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    run_id, sent = started(engine, app)
    with engine.begin() as conn:  # cancelled while the reserve's outcome is unknown
        moved = app.cancel(conn, run_id, actor="ops", reason="customer withdrew")
    assert [(r.state, r.step) for r in moved.moved] == [("queued", "compensating")]
    with engine.begin() as conn:  # the stock consumer's answer arrives now: kept
        assert app.confirm(conn, run_id=run_id, confirmation_id=sent, outcome="done",
                           evidence={"ref": "R-1"}, actor="stock")
    with engine.begin() as conn:  # once
        assert not app.confirm(conn, run_id=run_id, confirmation_id=sent, outcome="done",
                               evidence={"ref": "R-1"}, actor="stock")
    turn(engine, app)
    after = row(engine, run_id)
    assert (after.state, after.effects) == ("waiting", ["compensating"])
    assert after.reason.startswith("undoing reserve: sent release")


def test_an_operation_recorded_without_the_runs_id_tells_the_outcome(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    run_id, sent = started(engine, app)
    ledger = Ledger()
    with engine.begin() as conn:  # ctx.perform(...) without run_id=: the message id only
        op = ledger.begin(conn, key=f"{sent}:reserve", system="stock", operation="reserve",
                          request={}, message_id=sent).operation
    with engine.begin() as conn:
        ledger.record_outcome(conn, op.id, Applied(Evidence(reference="R-9")))
    with engine.begin() as conn:
        app.move(conn, run_id, "failed", actor="ops", reason="cancel")
    turn(engine, app)
    assert row(engine, run_id).effects == ["compensating"]
    with engine.connect() as conn:
        payload = conn.execute(text(
            "SELECT convert_from(payload, 'UTF8')::jsonb FROM outboxkit.outbox_messages "
            "WHERE message_id = :m"), {"m": compensation_id(sent)}).scalar_one()
    assert payload["compensates"]["evidence"]["operations"][0]["reference"] == "R-9"


def test_a_retired_workflows_run_still_undoes_its_effects(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    run_id, sent = started(engine, app)
    with engine.begin() as conn:
        app.confirm(conn, run_id=run_id, confirmation_id=sent, outcome="running",
                    evidence={"ref": "R-1"}, actor="stock")
        app.retire(conn, "w", reason="v2 replaces it")
    with engine.begin() as conn:  # its lease ran out: as an operator sees it
        conn.execute(text("UPDATE outboxkit.agent_runs SET state = 'waiting', "
                          "lease_owner = NULL, lease_expires_at = NULL WHERE id = :r"),
                     {"r": run_id})
        app.cancel(conn, run_id, actor="ops")
    turn(engine, app)
    assert row(engine, run_id).reason.startswith("undoing reserve")


def test_the_async_handle_records_compensates_and_cancels_as_the_sync_one(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    @app.workflow("a", version="1")
    async def a(job: AsyncClaimedRun[Any]) -> None:
        raise AssertionError("not run")

    async def go() -> tuple[uuid.UUID, uuid.UUID, list[Any]]:
        aengine = create_async_engine(sqlalchemy_url(database_url))
        try:
            async with aengine.begin() as conn:
                run = await app.start_run_async(conn, "a", idempotency_key="k")
            async with aengine.begin() as conn:
                job = await app.claim_async(conn, worker="w1", lease_seconds=30)
                assert job is not None
                sent = await job.emit(effect("reserve"), compensation=effect("release"))
                effects = await job.effects()
                await job.compensate(reason="changed its mind")
            async with aengine.begin() as conn:
                with pytest.raises(IllegalTransition, match="compensating"):
                    await app.move_async(conn, run.id, "failed", actor="ops")
            async with aengine.begin() as conn:
                cancelled = await app.cancel_async(conn, run.id, actor="ops")
                assert cancelled.compensating == [run.id]
            return run.id, sent, effects
        finally:
            await aengine.dispose()

    run_id, sent, effects = asyncio.run(go())
    assert [(e.message_id, e.type, e.state) for e in effects] == [(sent, "reserve", "open")]
    assert row(engine, run_id).state == "queued"
    with engine.begin() as conn:
        app.confirm(conn, run_id=run_id, confirmation_id=sent, outcome="failed",
                    evidence={"out of stock": True}, actor="stock")
    turn(engine, app)  # the reserve was refused: nothing to undo, the run is failed
    done = row(engine, run_id)
    assert (done.state, done.effects, done.compensating) == ("failed", ["not-applied"], False)


def test_an_outcome_unknown_too_long_goes_to_a_person_who_keeps_the_effect(
        engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    app = App(database_url=database_url)
    run_id, sent = started(engine, app)
    with engine.begin() as conn:
        app.move(conn, run_id, "failed", actor="ops", reason="cancel")
    turn(engine, app)  # nobody answered the reserve: it waits to learn
    assert row(engine, run_id).reason.startswith("learning whether reserve")
    with engine.begin() as conn, pytest.raises(RunError, match="needs-human"):
        app.keep_effect(conn, run_id, sent, actor="ops", reason="stock says no such hold")
    monkeypatch.setattr(compensations, "LEARN_LIMIT", timedelta(0))
    with engine.begin() as conn:
        app.wake(conn, run_id)
    turn(engine, app)  # waited longer than the limit: to a person, naming the effect
    person = row(engine, run_id)
    assert person.state == "needs-human"
    assert f"whether reserve ({sent}) took effect is still unknown" in person.reason
    with engine.begin() as conn, pytest.raises(RunError, match="no effect"):
        app.keep_effect(conn, run_id, uuid.uuid4(), actor="ops", reason="typo")
    with engine.begin() as conn:
        kept = app.keep_effect(conn, run_id, sent, actor="ops", reason="stock says no hold")
        assert (kept.state, kept.compensation_evidence["kept_by"]) == ("kept", "ops")
        app.move(conn, run_id, "queued", actor="ops", reason="go on")
    turn(engine, app)
    done = row(engine, run_id)
    assert (done.state, done.effects, done.reason) == (
        "failed", ["kept"], "compensated: 0 effect(s) undone")


def test_emit_many_records_the_undo_of_each_effect_that_has_one(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    @app.workflow("m", version="1")
    def m(job: ClaimedRun[Any]) -> None:
        raise AssertionError("not run")

    with engine.begin() as conn:
        app.start_run(conn, m, idempotency_key="k")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w1", lease_seconds=30)
        assert job is not None
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="one per envelope"):
        job.on(conn).emit_many([effect("reserve"), effect("charge")],
                               compensations=[effect("release")])
    with engine.begin() as conn:
        ids = job.on(conn).emit_many([effect("reserve"), effect("notify"), effect("charge")],
                                     compensations=[effect("release"), None, effect("refund")])
        effects = job.on(conn).effects()
    assert [(e.message_id, e.type) for e in effects] == [(ids[0], "reserve"),
                                                         (ids[2], "charge")]
    with engine.connect() as conn:
        sent = conn.execute(text("SELECT count(*) FROM outboxkit.outbox_messages")).scalar_one()
    assert sent == 3  # the refused batch wrote nothing
