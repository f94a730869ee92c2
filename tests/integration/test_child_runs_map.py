"""A bounded fan-out (``app.start_children(job, child, items, concurrency=n)``, migration
0015's trigger) against real PostgreSQL and the worker: 100 children, never more than 10 at
once, each run once, the parent woken once with every output; started once however often
the step runs; bad input refused before anything is written."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from outbox import App, ClaimedRun, Envelope
from outbox.db.execution import run_plan
from outbox.errors import ConfigurationError
from outbox.runs import children
from tests.integration.worker_support import run_in, running, wait_for


class Item(BaseModel):
    n: int


class Gauge:
    """How many child steps run at once, at most."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.runs: list[int] = []

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.now -= 1


def _turns(database_url: str) -> tuple[App, Any]:
    """An app whose runs the test moves by hand, one turn at a time."""
    app = App(database_url=database_url)

    @app.workflow("child", version="1")
    def child(job: ClaimedRun[Item]) -> None:
        raise AssertionError("the test takes the turns")

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        raise AssertionError("the test takes the turns")

    return app, child


def _claim(app: App, engine: Engine, workflow: str, worker: str = "w") -> Any:
    with engine.begin() as conn:
        return app.claim(conn, worker=worker, lease_seconds=60, workflows=[workflow])


def _one_fails(app: App, n: int, reason: str) -> Any:
    """A child workflow whose item *n* fails with *reason*, a second after the others began
    waiting for something that does not come (so that the siblings' reasons are the
    cancel's; a sibling still inside its step is failed when it ends:
    test_a_child_inside_its_step_when_its_parent_is_cancelled_fails_once_the_step_ends)."""

    @app.workflow("child", version="1")
    def child(job: ClaimedRun[Item]) -> None:
        if job.checkpoint.n == n:
            time.sleep(1.0)
            job.transition("failed", reason=reason)
        else:
            job.transition("waiting", reason="waits for the warehouse")

    return child


def test_a_hundred_children_ten_at_a_time_each_once_and_the_parent_woken_once(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    gauge = Gauge()
    parent_steps: list[str | None] = []

    @app.workflow("square", version="1")
    def square(job: ClaimedRun[Item]) -> None:
        with gauge:
            gauge.runs.append(job.checkpoint.n)
            time.sleep(0.05)
        job.transition("done", reason="squared", evidence={"square": job.checkpoint.n ** 2})

    @app.workflow("sum", version="1")
    def total(job: ClaimedRun[Any]) -> None:
        parent_steps.append(job.run.step)
        if job.run.step != "joined":
            app.start_children(job, square, {f"n{n}": Item(n=n) for n in range(100)},
                               concurrency=10)
            job.wait_for_children("all", step="joined")
            return
        kids = job.children()
        job.transition("done", reason="summed",
                       evidence={"sum": sum(k.last_evidence["square"] for k in kids),
                                 "count": len(kids)})

    with running(app, concurrency=24):
        with engine.begin() as conn:
            run = app.start_run(conn, total, idempotency_key="sum-100")
        done = run_in(engine, run.id, "done", timeout=60)
    assert done.last_evidence == {"sum": sum(n * n for n in range(100)), "count": 100}
    assert sorted(gauge.runs) == list(range(100))  # each child once
    assert 1 < gauge.most <= 10, gauge.most
    assert parent_steps == [None, "joined"]  # woken once


def test_the_step_run_again_starts_nothing_more_and_other_input_is_refused(
        engine: Engine, database_url: str) -> None:
    app, child = _turns(database_url)
    with engine.begin() as conn:
        run = app.start_run(conn, "parent", idempotency_key="p")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=30, workflows=["parent"])
        assert job is not None
        first = app.start_children(job, child, {f"k{n}": Item(n=n) for n in range(5)},
                                   concurrency=2)
    with engine.begin() as conn:  # the same step again, after a crash: the same children
        again = app.start_children(job.on(conn), child,
                                   {f"k{n}": Item(n=n) for n in range(6)}, concurrency=2)
    assert [r.id for r in again[:5]] == [r.id for r in first]
    assert held_ones(engine, run.id) == ["k2", "k3", "k4", "k5"]
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="'k1' already"):
        app.start_children(job.on(conn), child, {"k0": Item(n=0), "k1": Item(n=7),
                                                 "k9": Item(n=9)})
    bad: list[tuple[Any, Any, str]] = [
        ([("k", Item(n=1))], None, "map each child's key"),
        ({"": Item(n=1)}, None, "non-empty string"),
        ({"k": Item(n=1)}, 0, "whole number >= 1"),
    ]
    for items, concurrency, said in bad:
        with engine.begin() as conn, pytest.raises(ConfigurationError, match=said):
            app.start_children(job.on(conn), child, items, concurrency=concurrency)
    with engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM outboxkit.agent_runs "
                                  "WHERE parent_id = :p"), {"p": run.id}).scalar_one()
    assert count == 6  # k9 was not started: the batch is refused whole


def test_cancelling_a_parent_fails_its_held_children_too(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    @app.workflow("child", version="1")
    def child(job: ClaimedRun[Item]) -> None:
        return None

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        app.start_children(job, child, {f"k{n}": Item(n=n) for n in range(4)}, concurrency=1)
        job.wait_for_children("all", step="joined")

    with engine.begin() as conn:
        run = app.start_run(conn, parent, idempotency_key="p")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=30, workflows=["parent"])
        assert job is not None
        parent(job)
    with engine.connect() as conn:
        kids = {r.idempotency_key.split("/")[1]: r for r in
                [app.get_run(conn, i) for i in conn.execute(text(
                    "SELECT id FROM outboxkit.agent_runs WHERE parent_id = :p"),
                    {"p": run.id}).scalars()]}
    assert {k: r.held for k, r in kids.items()} == {"k0": False, "k1": True, "k2": True,
                                                   "k3": True}
    with engine.begin() as conn:  # one held child cancelled: its place was never taken
        app.cancel(conn, kids["k2"].id, actor="ops")
    assert held_ones(engine, run.id) == ["k1", "k3"]
    with engine.begin() as conn:
        done = app.cancel(conn, run.id, actor="ops")
    assert [r.state.value for r in done.moved] == ["failed"] * 4  # the parent and 3 left
    with engine.connect() as conn:  # none released by its siblings' failures
        assert conn.execute(text("SELECT count(*) FROM outboxkit.agent_runs WHERE state <> "
                                 "'failed'")).scalar_one() == 0


def test_a_child_inside_its_step_when_its_parent_is_cancelled_fails_once_the_step_ends(
        engine: Engine, database_url: str) -> None:
    """The cancel cannot move a child a worker holds (its step runs): it is left to end its
    step, and when that step ends in ``waiting`` the worker fails it, since its parent
    failed meanwhile. Without that, the child would wait for good."""
    app = App(database_url=database_url)
    inside, release = threading.Event(), threading.Event()

    @app.workflow("child", version="1")
    def child(job: ClaimedRun[Item]) -> None:
        inside.set()
        release.wait(10)
        job.transition("waiting", reason="waits for the warehouse")

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        app.start_children(job, child, {"k0": Item(n=0)})
        job.wait_for_children("all", step="joined")

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, parent, idempotency_key="p")
        assert inside.wait(10), "the child's step never ran"
        with engine.begin() as conn:
            cancelled = app.cancel(conn, run.id, actor="ops")
        with engine.connect() as conn:
            kid_id = conn.execute(text("SELECT id FROM outboxkit.agent_runs WHERE parent_id "
                                       "= :p"), {"p": run.id}).scalar_one()
        assert cancelled.held == [kid_id]  # held by the worker: left to end its step
        release.set()
        ended = run_in(engine, kid_id, "failed")
    assert ended.reason == f"its parent {run.id} failed while this run's step ran"
    with engine.connect() as conn:
        moves = [str(t.to_state) for t in app.history(conn, kid_id)]
    assert moves[-2:] == ["waiting", "failed"]


def held_ones(engine: Engine, parent_id: Any) -> list[str]:
    with engine.connect() as conn:
        return [k.split("/")[1] for k in conn.execute(text(
            "SELECT idempotency_key FROM outboxkit.agent_runs WHERE parent_id = :p AND state = "
            "'queued' AND not_before >= '9000-01-01 00:00:00+00' ORDER BY not_before"),
            {"p": parent_id}).scalars()]


def test_a_second_batch_with_the_first_ones_keys_holds_only_what_is_over_the_bound(
        engine: Engine, database_url: str) -> None:
    app, child = _turns(database_url)
    with engine.begin() as conn:
        run = app.start_run(conn, "parent", idempotency_key="p")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=30, workflows=["parent"])
        assert job is not None
        app.start_children(job, child, {"a": Item(n=1), "b": Item(n=2)}, concurrency=2)
    with engine.begin() as conn:  # both finish (the bound has no one to release)
        conn.execute(text("UPDATE outboxkit.agent_runs SET state = 'done' "
                          "WHERE parent_id = :p"), {"p": run.id})
    with engine.begin() as conn:  # the next turn maps a longer list with the same first keys
        again = app.start_children(job.on(conn), child, {k: Item(n=n) for n, k in enumerate(
            ["a", "b", "c", "d", "e"], start=1)}, concurrency=2)
    assert [r.held for r in again] == [False, False, False, False, True]
    assert held_ones(engine, run.id) == ["e"]


@pytest.mark.parametrize("fail_fast", [True, False])
def test_a_fail_fast_join_wakes_the_parent_at_the_first_failed_child(
        engine: Engine, database_url: str, fail_fast: bool) -> None:
    app = App(database_url=database_url)

    child = _one_fails(app, 1, "out of stock")

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        if job.run.step != "joined":
            app.start_children(job, child, {f"k{n}": Item(n=n) for n in range(3)})
            job.wait_for_children("all", step="joined", fail_fast=fail_fast)
            return
        failed = [c.idempotency_key for c in job.children() if c.state == "failed"]
        job.transition("failed", reason=f"a child failed: {failed}")

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, parent, idempotency_key="p")
        if fail_fast:
            done = run_in(engine, run.id, "failed")
            assert done.reason == f"a child failed: ['{run.id}/k1']"
        else:
            time.sleep(1.0)
            with engine.connect() as conn:
                assert app.get_run(conn, run.id).state == "waiting"  # waits for all three
        with engine.connect() as conn:
            waiting = conn.execute(text("SELECT count(*) FROM outboxkit.agent_runs WHERE "
                                        "parent_id = :p AND state = 'waiting'"),
                                   {"p": run.id}).scalar_one()
    assert waiting == 2


@pytest.mark.parametrize("on_failure", ["fail", "compensate"])
def test_a_declared_on_failure_fails_or_undoes_the_parent_and_cancels_the_others(
        engine: Engine, database_url: str, on_failure: str) -> None:
    app = App(database_url=database_url)
    woken: list[str | None] = []

    child = _one_fails(app, 1, "out of stock")

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        woken.append(job.run.step)
        job.emit(Envelope(topic="shop", type="hold", key="p", payload={}),
                 compensation=Envelope(topic="shop", type="unhold", key="p", payload={}))
        app.start_children(job, child, {f"k{n}": Item(n=n) for n in range(3)})
        job.wait_for_children("all", step="joined", on_failure=on_failure)  # type: ignore[arg-type]

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, parent, idempotency_key="p")
        # a child failed: the parent compensates (on_failure="fail" too: it has a hold to
        # undo), and first learns whether its hold took effect
        wait_for(lambda: "learning whether hold" in (_run(engine, run.id).reason or ""),
                 what="the parent to ask about its hold")
        with engine.connect() as conn:
            hold = conn.execute(text("SELECT message_id FROM outboxkit.outbox_messages "
                                     "WHERE message_type = 'hold'")).scalar_one()
        with engine.begin() as conn:
            app.confirm(conn, run_id=run.id, confirmation_id=hold, outcome="running",
                        evidence={"held": True}, actor="shop")
        wait_for(lambda: "unhold" in _types(engine), what="the undo")
        with engine.connect() as conn:
            undo = conn.execute(text("SELECT message_id FROM outboxkit.outbox_messages "
                                     "WHERE message_type = 'unhold'")).scalar_one()
        run_in(engine, run.id, "waiting")
        with engine.begin() as conn:
            app.confirm(conn, run_id=run.id, confirmation_id=undo, outcome="running",
                        evidence={"unheld": True}, actor="shop")
        done = run_in(engine, run.id, "failed")
    assert woken == [None]  # its code ran once: the failed child did the rest
    assert done.reason == "compensated: 1 effect(s) undone"
    with engine.connect() as conn:
        moves = [t.reason for t in app.history(conn, run.id)]
        kids = conn.execute(text("SELECT idempotency_key, state, reason FROM outboxkit.agent_runs "
                                 "WHERE parent_id = :p ORDER BY idempotency_key"),
                            {"p": run.id}).all()
    assert "compensating: child 'k1' failed: out of stock" in moves
    assert [(k.split("/")[1], s) for k, s, _ in kids] == [
        ("k0", "failed"), ("k1", "failed"), ("k2", "failed")]
    assert kids[0].reason == "its sibling child 'k1' failed: out of stock"


def _types(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT message_type FROM outboxkit.outbox_messages "
                                      "ORDER BY id")).scalars())


def _run(engine: Engine, run_id: Any) -> Any:
    with engine.connect() as conn:
        return App().get_run(conn, run_id)


def test_on_failure_fail_without_effects_just_fails_the_parent(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    child = _one_fails(app, 0, "no")

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        app.start_children(job, child, {f"k{n}": Item(n=n) for n in range(4)}, concurrency=2)
        job.wait_for_children("all", step="joined", on_failure="fail")

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, parent, idempotency_key="p")
        done = run_in(engine, run.id, "failed")
    assert (done.reason, done.compensating_since) == ("child 'k0' failed: no", None)
    with engine.connect() as conn:  # the held ones were cancelled too, none released
        states = conn.execute(text("SELECT state, count(*) FROM outboxkit.agent_runs "
                                   "WHERE parent_id = :p GROUP BY state"), {"p": run.id}).all()
    assert dict(states) == {"failed": 4}
    with engine.connect() as conn:  # only the two it started ran: no held one was released
        ran = conn.execute(text(
            "SELECT count(DISTINCT t.run_id) FROM outboxkit.run_transitions t JOIN "
            "outboxkit.agent_runs r ON r.id = t.run_id WHERE r.parent_id = :p "
            "AND t.to_state = 'running'"), {"p": run.id}).scalar_one()
    assert ran == 2
    with engine.begin() as conn:
        app.start_run(conn, parent, idempotency_key="q")
        job = app.claim(conn, worker="w", lease_seconds=30)
    assert job is not None
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="on_failure must"):
        job.on(conn).wait_for_children("all", on_failure="retry")  # type: ignore[arg-type]


def test_on_failure_acts_on_the_failure_that_woke_the_parent_and_no_other(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    steps: list[str | None] = []

    @app.workflow("child", version="1")
    def child(job: ClaimedRun[Item]) -> None:
        if job.checkpoint.n == 0:
            job.transition("failed", reason="no")

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        steps.append(job.run.step)
        if job.run.step is None:  # wave 1: a plain join; one child fails
            app.start_children(job, child, {"a": Item(n=0), "b": Item(n=1)})
            job.wait_for_children("all", step="wave-1")
        elif job.run.step == "wave-1":  # it handles that itself, then declares on_failure
            app.start_children(job, child, {"c": Item(n=2)})
            job.wait_for_children("all", step="wave-2", on_failure="fail")
        else:
            job.transition("done", reason="wave 2 went well", evidence={"ok": True})

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, parent, idempotency_key="p")
        done = run_in(engine, run.id, "done", timeout=20)
    assert steps == [None, "wave-1", "wave-2"]  # 'a' failing in wave 1 did not fail it later
    assert (done.on_child_failure, done.failed_child) == (None, None)


def test_on_failure_leaves_a_sibling_a_worker_holds_and_fails_the_parent(
        engine: Engine, database_url: str) -> None:
    app, child = _turns(database_url)
    with engine.begin() as conn:
        run = app.start_run(conn, "parent", idempotency_key="p")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=30, workflows=["parent"])
        assert job is not None
        kids = app.start_children(job, child, {"a": Item(n=0), "b": Item(n=1)})
        job.wait_for_children("all", on_failure="fail")
    with engine.begin() as conn:  # a worker holds 'a' (its lease lives)
        a = app.claim(conn, worker="w-a", lease_seconds=60, workflows=["child"])
        assert a is not None
        assert a.run.id == kids[0].id
    with engine.begin() as conn:  # 'b' fails: it wakes the parent, naming itself
        b = app.claim(conn, worker="w-b", lease_seconds=60, workflows=["child"])
        assert b is not None
        b.transition("failed", reason="out of stock")
    with engine.begin() as conn:
        woken = app.claim(conn, worker="w", lease_seconds=30, workflows=["parent"])
    assert woken is not None
    assert woken.run.failed_child == kids[1].id
    with engine.begin() as conn:
        moved = run_plan(conn, children.failure_plan(woken.lease, woken.run, actor="w",
                                                     settings=None))
    assert moved is not None
    with engine.connect() as conn:
        states = {r.idempotency_key.split("/")[-1]: r.state.value for r in
                  [app.get_run(conn, i) for i in (run.id, kids[0].id, kids[1].id)]}
    assert states == {"p": "failed", "a": "running", "b": "failed"}  # 'a': its step ends it


def test_a_late_failure_of_an_earlier_wave_still_frees_its_place(
        engine: Engine, database_url: str) -> None:
    app, child = _turns(database_url)
    with engine.begin() as conn:
        app.start_run(conn, "parent", idempotency_key="p")
    job = _claim(app, engine, "parent")
    with engine.begin() as conn:  # wave 1, one at a time, joined by the first to finish
        _, b = app.start_children(job.on(conn), child, {"a": Item(n=0), "b": Item(n=1)},
                                  concurrency=1)
        job.on(conn).wait_for_children("first")
    with engine.begin() as conn:
        _claim(app, engine, "child").on(conn).transition("done", reason="ok", evidence={"ok": 1})
    woken = _claim(app, engine, "parent")  # 'first' met; b was released
    with engine.begin() as conn:  # wave 2 starts held (b still runs) and declares a policy
        c, _ = app.start_children(woken.on(conn), child, {"c": Item(n=2), "d": Item(n=3)},
                                  concurrency=1)
        woken.on(conn).wait_for_children("all", on_failure="fail")
    late = _claim(app, engine, "child")
    assert late.run.id == b.id
    with engine.begin() as conn:  # b, of wave 1, fails: not the policy's business
        late.on(conn).transition("failed", reason="late")
    nxt = _claim(app, engine, "child")
    assert nxt is not None
    assert nxt.run.id == c.id  # its place went to wave 2


def test_after_a_failure_woke_the_parent_no_held_child_is_released(
        engine: Engine, database_url: str) -> None:
    app, child = _turns(database_url)
    with engine.begin() as conn:
        app.start_run(conn, "parent", idempotency_key="p")
    job = _claim(app, engine, "parent")
    with engine.begin() as conn:
        app.start_children(job.on(conn), child, {"a": Item(n=0), "b": Item(n=1),
                                                 "c": Item(n=2)}, concurrency=2)
        job.on(conn).wait_for_children("all", on_failure="fail")
    first, second = _claim(app, engine, "child"), _claim(app, engine, "child")
    with engine.begin() as conn:
        first.on(conn).transition("failed", reason="no")
    with engine.begin() as conn:  # a sibling finishing after the wake frees no place
        second.on(conn).transition("done", reason="ok", evidence={"ok": 1})
    assert _claim(app, engine, "child", worker="w-c") is None


def test_a_wait_declared_after_a_child_failed_applies_its_policy(
        engine: Engine, database_url: str) -> None:
    app, child = _turns(database_url)
    with engine.begin() as conn:
        app.start_run(conn, "parent", idempotency_key="p")
    job = _claim(app, engine, "parent")
    with engine.begin() as conn:
        a, _ = app.start_children(job.on(conn), child, {"a": Item(n=0), "b": Item(n=1)})
    for outcome in ("failed", "done"):  # both finish before the parent waits
        with engine.begin() as conn:
            _claim(app, engine, "child").on(conn).transition(
                outcome, reason=outcome, evidence={"ok": 1} if outcome == "done" else None)
    with engine.begin() as conn:
        job.on(conn).wait_for_children("all", on_failure="fail")
    woken = _claim(app, engine, "parent")
    assert woken.run.failed_child == a.id
    with engine.begin() as conn:
        assert run_plan(conn, children.failure_plan(woken.lease, woken.run, actor="w",
                                                    settings=None)) is not None
