"""Compensation: a run undoes its confirmed effects, the last first, each once, with evidence;
an effect whose outcome is unknown is learnt first (real PostgreSQL, the worker, the
operations ledger standing where the consumers would call it)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, text

from dedup.ledger import Applied, Evidence, Ledger, Refused
from outbox import App, ClaimedRun, Envelope, RetryPolicy
from outbox.errors import ConfigurationError, IllegalTransition, LeaseSpent
from outbox.runs.compensation import compensation_id
from outbox.runs.lifecycle import history
from tests.integration.worker_support import run_in, running, wait_for

STEPS = ("reserve", "charge", "ship")
UNDO = {"reserve": "release", "charge": "refund", "ship": "cancel-shipment"}


def effect(kind: str, order: str) -> Envelope:
    return Envelope(topic="saga", type=kind, key=order, payload={"order": order})


def saga(app: App, *, then: str = "compensate") -> Any:
    """Three effects, one per step, each waiting for its outcome (the ledger resumes the
    run); after the third, *then*: ``compensate`` (a step decides to undo), ``raise``
    (the step fails for good) or ``done``."""

    @app.workflow("order", version="1", retry=RetryPolicy(max_attempts=1))
    def order(job: ClaimedRun[dict[str, Any]]) -> None:
        done = len(job.effects())
        if done < len(STEPS):
            kind = STEPS[done]
            job.emit(effect(kind, job.checkpoint["order"]),
                     compensation=effect(UNDO[kind], job.checkpoint["order"]))
            job.transition("waiting", step=kind, reason=f"{kind} sent")
            return
        if then == "compensate":
            job.compensate(reason="the customer cancelled", evidence={"by": "customer"})
        elif then == "raise":
            raise RuntimeError("shipping label printer on fire")

    return order


def messages(engine: Engine, run_id: uuid.UUID) -> list[tuple[uuid.UUID, str]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT message_id, message_type FROM outboxkit.outbox_messages "
                                 "WHERE run_id = :r ORDER BY id"), {"r": run_id}).all()
    return [(r.message_id, r.message_type) for r in rows]


def settle(engine: Engine, run_id: uuid.UUID, message_id: uuid.UUID, *, applied: bool = True,
           open_only: bool = False) -> uuid.UUID:
    """What a consumer does with the ledger: record the intent (run-linked, resume), then the
    outside system's answer (unless *open_only*: the outcome stays unknown)."""
    ledger = Ledger()
    with engine.begin() as conn:
        intent = ledger.begin(conn, key=f"{message_id}:call", system="shop", operation="call",
                              request={"m": str(message_id)}, run_id=run_id,
                              message_id=message_id, on_settle="resume")
    if not open_only:
        answer = Evidence(reference=f"ref-{str(message_id)[:8]}", detail={"ok": applied})
        with engine.begin() as conn:
            ledger.record_outcome(conn, intent.operation.id,
                                  Applied(answer) if applied else Refused(answer))
    return intent.operation.id


def drive(engine: Engine, run_id: uuid.UUID, count: int) -> list[uuid.UUID]:
    """Confirm the run's first *count* effects, each once it is sent and the run waits."""
    sent: list[uuid.UUID] = []
    for n in range(count):
        wait_for(lambda n=n: len(messages(engine, run_id)) > n, what=f"effect {n + 1}")
        run_in(engine, run_id, "waiting")
        sent.append(messages(engine, run_id)[n][0])
        settle(engine, run_id, sent[-1])
    return sent


def test_a_step_that_undoes_compensates_each_confirmed_effect_once_last_first(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    saga(app)
    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, "order", idempotency_key="o-1", checkpoint={"order": "o-1"})
        originals = drive(engine, run.id, 3)
        for n, (original, undo) in enumerate(zip(reversed(originals),
                                                 ["cancel-shipment", "refund", "release"],
                                                 strict=True)):
            wait_for(lambda n=n: len(messages(engine, run.id)) > 3 + n,
                     what=f"compensation {n}")
            sent, kind = messages(engine, run.id)[3 + n]
            assert (sent, kind) == (compensation_id(original), undo)
            run_in(engine, run.id, "waiting")
            settle(engine, run.id, sent)
        failed = run_in(engine, run.id, "failed")
    assert [t for _, t in messages(engine, run.id)] == [
        "reserve", "charge", "ship", "cancel-shipment", "refund", "release"]
    with engine.connect() as conn:
        payload = json.loads(conn.execute(text(
            "SELECT payload FROM outboxkit.outbox_messages WHERE message_id = :m"),
            {"m": compensation_id(originals[0])}).scalar_one())
        moves = [(t.to_state, t.step, t.reason) for t in history(conn, run.id)]
    compensates = payload["compensates"]
    assert compensates["message_id"] == str(originals[0])
    assert compensates["type"] == "reserve"
    assert compensates["evidence"]["operations"][0]["reference"] == f"ref-{str(originals[0])[:8]}"
    assert payload["order"] == "o-1"
    assert failed.reason == "compensated: 3 effect(s) undone"
    assert [e["state"] for e in failed.last_evidence["effects"]] == ["compensated"] * 3
    assert ("failed", "ship", "compensating: the customer cancelled") in moves
    assert sum(1 for m in moves if m[2] and m[2].startswith("undoing ")) == 3


def test_a_step_that_fails_for_good_undoes_what_took_effect_and_skips_what_was_refused(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    saga(app, then="raise")
    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, "order", idempotency_key="o-2", checkpoint={"order": "o-2"})
        reserve, charge = drive(engine, run.id, 2)
        wait_for(lambda: len(messages(engine, run.id)) > 2, what="the shipment")
        run_in(engine, run.id, "waiting")
        ship = messages(engine, run.id)[2][0]
        settle(engine, run.id, ship, applied=False)  # refused: the step goes on, then raises
        for original in (charge, reserve):
            wait_for(lambda o=original: compensation_id(o) in dict(messages(engine, run.id)),
                     what="its compensation")
            run_in(engine, run.id, "waiting")
            settle(engine, run.id, compensation_id(original))
        failed = run_in(engine, run.id, "failed")
        moves = [(t.to_state, t.reason) for t in app.history(engine.connect(), run.id)]
    states = {e["type"]: e["state"] for e in failed.last_evidence["effects"]}
    assert states == {"ship": "not-applied", "charge": "compensated", "reserve": "compensated"}
    assert [t for _, t in messages(engine, run.id)] == [
        "reserve", "charge", "ship", "refund", "release"]
    assert ("failed", "compensating: attempt 1 failed for good: RuntimeError: shipping label "
            "printer on fire") in moves


def app_run(engine: Engine, run_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        return App().get_run(conn, run_id)


def test_a_refused_compensation_goes_to_a_person_who_lets_the_effect_stay(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    saga(app)
    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, "order", idempotency_key="o-3", checkpoint={"order": "o-3"})
        originals = drive(engine, run.id, 3)
        wait_for(lambda: len(messages(engine, run.id)) > 3, what="the first compensation")
        run_in(engine, run.id, "waiting")
        settle(engine, run.id, compensation_id(originals[2]), applied=False)  # already shipped
        person = run_in(engine, run.id, "needs-human")
        assert "was refused" in (person.reason or "")
        with engine.begin() as conn:
            app.move(conn, run.id, "queued", actor="ops", reason="shipped: the customer keeps it")
        for original in (originals[1], originals[0]):
            wait_for(lambda o=original: compensation_id(o) in dict(messages(engine, run.id)),
                     what="its compensation")
            run_in(engine, run.id, "waiting")
            settle(engine, run.id, compensation_id(original))
        failed = run_in(engine, run.id, "failed")
    assert [e["state"] for e in failed.last_evidence["effects"]] == [
        "kept", "compensated", "compensated"]
    assert failed.reason == "compensated: 2 effect(s) undone"


def test_a_confirmation_that_fails_the_run_compensates_it_first(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    saga(app, then="done")
    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, "order", idempotency_key="o-4", checkpoint={"order": "o-4"})
        (reserve,) = drive(engine, run.id, 1)
        wait_for(lambda: len(messages(engine, run.id)) > 1, what="the charge")
        run_in(engine, run.id, "waiting")
        charge = messages(engine, run.id)[1][0]
        with engine.begin() as conn:  # the payment consumer fails the run outright
            assert app.confirm(conn, run_id=run.id, confirmation_id=charge, outcome="failed",
                               evidence={"declined": True}, actor="payments")
            assert app.get_run(conn, run.id).state == "queued"
        wait_for(lambda: compensation_id(reserve) in dict(messages(engine, run.id)),
                 what="the release")
        run_in(engine, run.id, "waiting")
        with engine.begin() as conn:  # confirmed without the ledger: a plain confirmation
            assert app.confirm(conn, run_id=run.id, confirmation_id=compensation_id(reserve),
                               outcome="done", evidence={"released": True}, actor="stock")
        failed = run_in(engine, run.id, "failed")
    assert [e["state"] for e in failed.last_evidence["effects"]] == ["not-applied", "compensated"]
    assert failed.last_evidence["effects"][1]["compensation_evidence"]["confirmation"][
        "evidence"] == {"released": True}


def test_an_operator_cancel_compensates_and_a_run_without_effects_just_fails(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    saga(app)
    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, "order", idempotency_key="o-5", checkpoint={"order": "o-5"})
            plain = app.start_run(conn, "order", idempotency_key="o-6",
                                  checkpoint={"order": "o-6"})
        (reserve,) = drive(engine, run.id, 1)
        run_in(engine, plain.id, "waiting")
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM outboxkit.run_effects WHERE run_id = :r"),
                         {"r": plain.id})
            app.move(conn, plain.id, "failed", actor="ops", reason="cancelled")
            assert app.get_run(conn, plain.id).state == "failed"
        wait_for(lambda: len(messages(engine, run.id)) > 1, what="the charge")
        run_in(engine, run.id, "waiting")
        with engine.begin() as conn:
            moved = app.move(conn, run.id, "failed", actor="ops", reason="cancelled")
            assert (moved.state, moved.step) == ("queued", "compensating")
        # the charge was never answered: its outcome is learnt before anything is decided
        wait_for(lambda: "learning whether charge" in (app_run(engine, run.id).reason or ""),
                 what="the run to wait for the charge")
        charge = messages(engine, run.id)[1][0]
        op = settle(engine, run.id, charge, open_only=True)  # called; no answer yet
        with engine.begin() as conn:
            app.wake(conn, run.id)

        def looks() -> int:
            with engine.connect() as conn:
                return sum(1 for t in app.history(conn, run.id)
                           if (t.reason or "").startswith("learning whether charge"))

        # sooner than the 5 s recheck: the wake made it
        wait_for(lambda: looks() >= 2, timeout=2.5, what="a second look, woken")
        assert len(messages(engine, run.id)) == 2  # still nothing decided
        with engine.begin() as conn:  # the status query: it was refused
            Ledger().record_outcome(conn, op, Refused(Evidence(reference="declined")))
        wait_for(lambda: compensation_id(reserve) in dict(messages(engine, run.id)),
                 what="the release")
        run_in(engine, run.id, "waiting")
        settle(engine, run.id, compensation_id(reserve))
        run_in(engine, run.id, "failed")


def test_bad_compensations_are_refused_before_anything_is_written(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    @app.workflow("bad", version="1")
    def bad(job: ClaimedRun[Any]) -> None:
        return None

    with engine.begin() as conn:
        run = app.start_run(conn, bad, idempotency_key="b")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=30)
    assert job is not None
    for undo, said in [(Envelope(topic="t", type="u", payload=[1]), "JSON object payload"),
                       (Envelope(topic="t", type="u", payload={"compensates": 1}),
                        "'compensates' is outbox's"),
                       (Envelope(topic="t", type="u", key=b"\xff", payload={}), "text key")]:
        with engine.begin() as conn, pytest.raises(ConfigurationError, match=said):
            job.on(conn).emit(effect("reserve", "b"), compensation=undo)
    assert messages(engine, run.id) == []
    with engine.begin() as conn:
        handle = job.on(conn)
        handle.compensate(reason="nothing to undo")
        with pytest.raises(LeaseSpent):
            handle.emit(effect("reserve", "b"))
    with running(app):
        failed = run_in(engine, run.id, "failed")
    assert failed.reason == "compensated: 0 effect(s) undone"


def test_cancel_fails_a_parent_and_its_unfinished_children_and_compensates_them(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    saga(app)

    @app.workflow("batch", version="1")
    def batch(job: ClaimedRun[Any]) -> None:
        for n in range(2):
            app.start_run(job.conn, "order", idempotency_key=str(n),
                          checkpoint={"order": f"b-{n}"}, parent=job)
        job.wait_for_children("all", step="orders")

    with running(app):
        with engine.begin() as conn:
            parent = app.start_run(conn, batch, idempotency_key="b")
        run_in(engine, parent.id, "waiting")
        with engine.connect() as conn:
            kids = [r[0] for r in conn.execute(text(
                "SELECT id FROM outboxkit.agent_runs WHERE parent_id = :p ORDER BY "
                "idempotency_key"), {"p": parent.id})]
        for kid in kids:
            wait_for(lambda k=kid: messages(engine, k), what="the child's first effect")
            run_in(engine, kid, "waiting")
        settle(engine, kids[0], messages(engine, kids[0])[0][0])  # the first's reserve took
        wait_for(lambda: len(messages(engine, kids[0])) > 1, what="the first's charge")
        run_in(engine, kids[0], "waiting")
        with engine.begin() as conn:
            done = app.cancel(conn, parent.id, actor="ops", reason="order withdrawn")
        assert [r.id for r in done.moved] == [parent.id, *kids]
        assert done.held == []
        assert [r.state for r in done.moved] == ["failed", "queued", "queued"]
        with engine.begin() as conn, pytest.raises(IllegalTransition, match="failed"):
            app.cancel(conn, parent.id, actor="ops")
        # the second child's reserve, and the first's charge, were never answered
        for kid, n in ((kids[1], 0), (kids[0], 1)):
            wait_for(lambda k=kid: "learning whether" in (app_run(engine, k).reason or ""),
                     what=f"the child to wait for an outcome: {app_run(engine, kid)}")
            settle(engine, kid, messages(engine, kid)[n][0], applied=False)
        run_in(engine, kids[1], "failed")
        reserve = messages(engine, kids[0])[0][0]
        wait_for(lambda: compensation_id(reserve) in dict(messages(engine, kids[0])),
                 what="the first child's release")
        run_in(engine, kids[0], "waiting")
        settle(engine, kids[0], compensation_id(reserve))
        run_in(engine, kids[0], "failed")
    assert app_run(engine, parent.id).state == "failed"  # not woken by its children
