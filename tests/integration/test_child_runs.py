"""Child runs and their join (outbox/runs/children.py, migration 0013's trigger) against real
PostgreSQL: a fan-out started once however often its step runs, the parent woken once its
join is met (by whatever finished the children), concurrent finishes, bad input refused."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from outbox import App, ClaimedRun, RunState
from outbox.errors import ConfigurationError, LeaseSpent
from outbox.runs.lifecycle import get_run
from tests.integration.worker_support import run_in, running


class Item(BaseModel):
    n: int


def _state(engine: Engine, run_id: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT state, not_before <= now() AS due, awaits_children "
            "FROM outboxkit.agent_runs WHERE id = :id"), {"id": run_id}).one()


def _app(database_url: str) -> tuple[App, Any, Any]:
    app = App(database_url=database_url)

    @app.workflow("square", version="1")
    def square(job: ClaimedRun[Item]) -> None:
        job.transition("done", reason="squared", evidence={"square": job.checkpoint.n ** 2})

    @app.workflow("sum", version="1")
    def total(job: ClaimedRun[Any]) -> None:
        if job.run.step != "joined":
            for n in range(1, 4):
                app.start_run(job.conn, square, idempotency_key=f"item-{n}",
                              checkpoint=Item(n=n), parent=job)
            job.wait_for_children("all", step="joined")
            return
        kids = job.children()
        job.transition("done", reason="summed",
                       evidence={"sum": sum(k.last_evidence["square"] for k in kids),
                                 "states": [k.state.value for k in kids]})

    return app, square, total


def test_a_parent_fans_out_waits_for_all_and_wakes_with_their_results(
        engine: Engine, database_url: str) -> None:
    app, _, total = _app(database_url)
    with running(app, concurrency=2):
        with engine.begin() as conn:
            run = app.start_run(conn, total, idempotency_key="sum-1")
        done = run_in(engine, run.id, "done", timeout=15)
    assert done.last_evidence == {"sum": 1 + 4 + 9, "states": ["done", "done", "done"]}
    with engine.connect() as conn:
        kids = conn.execute(text("SELECT idempotency_key FROM outboxkit.agent_runs "
                                 "WHERE parent_id = :id ORDER BY 1"), {"id": run.id}).all()
    assert [k[0] for k in kids] == [f"{run.id}/item-{n}" for n in range(1, 4)]


def _parent_with_children(engine: Engine, app: App, square: Any, total: Any,
                          count: int = 3) -> tuple[Any, Any, list[Any]]:
    with engine.begin() as conn:
        run = app.start_run(conn, total, idempotency_key="p")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=60, workflows=["sum"])
        assert job is not None
        kids = [app.start_run(conn, square, idempotency_key=f"k{n}", checkpoint=Item(n=n),
                              parent=job) for n in range(count)]
    return run, job, kids


def _finish(engine: Engine, app: App, run_id: Any, state: str = "done") -> None:
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=60, workflows=["square"])
        assert job is not None
        assert job.run.id == run_id
        job.transition(state, reason="test", evidence={"square": 0})


def test_starting_a_child_again_starts_nothing_and_other_input_is_refused(
        engine: Engine, database_url: str) -> None:
    app, square, total = _app(database_url)
    run, job, kids = _parent_with_children(engine, app, square, total)
    with engine.begin() as conn:
        again = app.start_run(conn, square, idempotency_key="k1", checkpoint=Item(n=1),
                              parent=job.on(conn))
    assert again.id == kids[1].id
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="another checkpoint"):
        app.start_run(conn, square, idempotency_key="k1", checkpoint=Item(n=99),
                      parent=job.on(conn))
    assert kids[1].parent_id == run.id


def test_the_join_counts_children_finished_before_the_wait_and_first_wakes_at_one(
        engine: Engine, database_url: str) -> None:
    app, square, total = _app(database_url)
    run, job, kids = _parent_with_children(engine, app, square, total)
    _finish(engine, app, kids[0].id, "failed")  # a failed child counts as finished
    with engine.begin() as conn:
        job.on(conn).wait_for_children("first")
    state = _state(engine, run.id)
    assert (state.state, state.due, state.awaits_children) == ("waiting", True, None)


def test_the_last_child_to_finish_wakes_the_parent_and_not_before(
        engine: Engine, database_url: str) -> None:
    app, square, total = _app(database_url)
    run, job, kids = _parent_with_children(engine, app, square, total)
    with engine.begin() as conn:
        job.on(conn).wait_for_children(2)
    assert _state(engine, run.id).awaits_children == 2
    _finish(engine, app, kids[0].id)
    assert _state(engine, run.id).due is None  # one of two: still waiting, not due
    _finish(engine, app, kids[1].id)
    state = _state(engine, run.id)
    assert (state.state, state.due, state.awaits_children) == ("waiting", True, None)


def test_children_finishing_at_once_in_two_transactions_wake_the_parent(
        engine: Engine, database_url: str) -> None:
    """Neither transaction sees the other's child finished when it moves its own: the wake
    runs at commit, on the parent's row, and the later commit counts both."""
    app, square, total = _app(database_url)
    run, job, kids = _parent_with_children(engine, app, square, total, count=2)
    with engine.begin() as conn:
        job.on(conn).wait_for_children("all")
    claimed = []
    for _ in kids:
        with engine.begin() as conn:
            got = app.claim(conn, worker="w", lease_seconds=60, workflows=["square"])
            assert got is not None
            claimed.append(got)
    with engine.connect() as first:
        tx = first.begin()
        claimed[0].on(first).transition("done", reason="a", evidence={"square": 0})
        with engine.begin() as conn:  # commits while the first is still open
            claimed[1].on(conn).transition("done", reason="b", evidence={"square": 0})
        assert _state(engine, run.id).due is None  # it counted one of two
        tx.commit()
    state = _state(engine, run.id)
    assert (state.state, state.due) == ("waiting", True)


def test_one_transaction_finishing_two_children_while_another_finishes_one_does_not_deadlock(
        engine: Engine, database_url: str) -> None:
    """The wake is deferred to the commit: a transaction moving two siblings locks their
    parent after both children, so it cannot hold the parent while waiting for a child."""
    app, square, total = _app(database_url)
    run, job, kids = _parent_with_children(engine, app, square, total, count=2)
    with engine.begin() as conn:
        job.on(conn).wait_for_children("all")
    for _ in kids:  # both wait for a confirmation, as after asking a supplier
        with engine.begin() as conn:
            child = app.claim(conn, worker="w", lease_seconds=60, workflows=["square"])
            assert child is not None
            child.transition("waiting", step="asked", reason="asked")
    errors: list[BaseException] = []
    with engine.connect() as first:
        tx = first.begin()
        app.confirm(first, run_id=kids[0].id, confirmation_id="a0", outcome="done",
                    evidence={"square": 0}, actor="a")

        def other() -> None:
            try:
                with engine.begin() as conn:
                    app.confirm(conn, run_id=kids[1].id, confirmation_id="b1",
                                outcome="done", evidence={"square": 0}, actor="b")
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(10)
        # The first goes on to the child the other just finished: a duplicate, no wait.
        assert not app.confirm(first, run_id=kids[1].id, confirmation_id="b1",
                               outcome="done", evidence={"square": 0}, actor="b")
        tx.commit()
    assert errors == []
    assert _state(engine, run.id).due is True


class TestRefused:
    def test_waiting_without_children_is_refused(self, engine: Engine,
                                                 database_url: str) -> None:
        app, _, total = _app(database_url)
        with engine.begin() as conn:
            app.start_run(conn, total, idempotency_key="p")
        with engine.begin() as conn:
            job = app.claim(conn, worker="w", lease_seconds=60)
            assert job is not None
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="no children"):
            job.on(conn).wait_for_children()

    @pytest.mark.parametrize("join", [0, 4, "most", True])
    def test_a_join_the_children_cannot_meet_is_refused(
            self, engine: Engine, database_url: str, join: Any) -> None:
        app, square, total = _app(database_url)
        run, job, _ = _parent_with_children(engine, app, square, total)
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="join must be"):
            job.on(conn).wait_for_children(join)
        assert _state(engine, run.id).state == "running"

    def test_a_step_whose_lease_ended_starts_no_child(
            self, engine: Engine, database_url: str) -> None:
        app, square, total = _app(database_url)
        with engine.begin() as conn:
            app.start_run(conn, total, idempotency_key="p")
        with engine.begin() as conn:
            job = app.claim(conn, worker="w", lease_seconds=60)
            assert job is not None
            job.release(reason="test")
            with pytest.raises(LeaseSpent):
                app.start_run(conn, square, idempotency_key="k", checkpoint=Item(n=1),
                              parent=job)


def test_a_child_finished_by_a_confirmation_wakes_its_parent_too(
        engine: Engine, database_url: str) -> None:
    """The trigger sees every path to a finished state, not only a worker's step: here a
    consumer's confirmation moves the waiting child to done."""
    app, square, total = _app(database_url)
    run, job, kids = _parent_with_children(engine, app, square, total, count=1)
    with engine.begin() as conn:
        job.on(conn).wait_for_children()
    with engine.begin() as conn:
        child = app.claim(conn, worker="w", lease_seconds=60, workflows=["square"])
        assert child is not None
        child.transition("waiting", step="asked", reason="asked the supplier")
    assert _state(engine, run.id).due is None
    with engine.begin() as conn:
        assert app.confirm(conn, run_id=kids[0].id, confirmation_id="c-1", outcome="done",
                           evidence={"square": 0}, actor="consumer")
    with engine.connect() as conn:
        assert get_run(conn, kids[0].id).state is RunState.DONE
    assert _state(engine, run.id).due is True


def test_a_second_wave_is_joined_on_its_own(engine: Engine, database_url: str) -> None:
    """A join counts the children started since the previous join: the first wave's
    finished children do not meet the second wave's 'first'."""
    app, square, total = _app(database_url)
    run, job, kids = _parent_with_children(engine, app, square, total, count=1)
    with engine.begin() as conn:
        job.on(conn).wait_for_children("all")
    _finish(engine, app, kids[0].id)
    assert _state(engine, run.id).due is True
    with engine.begin() as conn:  # woken: the parent starts a second wave and waits again
        again = app.claim(conn, worker="w", lease_seconds=60, workflows=["sum"])
        assert again is not None
        second = [app.start_run(conn, square, idempotency_key=f"w2-{n}", checkpoint=Item(n=n),
                                parent=again) for n in range(2)]
        again.wait_for_children("first")
    assert _state(engine, run.id).due is None  # the first wave does not count
    _finish(engine, app, second[0].id)
    assert _state(engine, run.id).due is True


def test_a_child_started_again_with_the_same_input_spelt_otherwise_is_the_same_child(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    @app.workflow("any", version="1")
    def anything(job: ClaimedRun[Any]) -> None:
        return None

    @app.workflow("parent", version="1")
    def parent(job: ClaimedRun[Any]) -> None:
        return None

    with engine.begin() as conn:
        app.start_run(conn, parent, idempotency_key="p")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=60, workflows=["parent"])
        assert job is not None
        first = app.start_run(conn, anything, idempotency_key="c",
                              checkpoint={"pair": (1, 2), "b": 1.0}, parent=job)
        again = app.start_run(conn, anything, idempotency_key="c",
                              checkpoint={"b": 1.0, "pair": [1, 2]}, parent=job)
    assert again.id == first.id


def test_a_step_whose_run_was_taken_over_starts_no_child(
        engine: Engine, database_url: str) -> None:
    """The lease is read in SQL under a share lock, not only in the handle."""
    from outbox.errors import LeaseLost  # noqa: PLC0415

    app, square, total = _app(database_url)
    with engine.begin() as conn:
        run = app.start_run(conn, total, idempotency_key="p")
    with engine.begin() as conn:
        job = app.claim(conn, worker="w", lease_seconds=60)
        assert job is not None
    with engine.begin() as conn:  # another worker took it over
        conn.execute(text("UPDATE outboxkit.agent_runs SET lease_token = lease_token + 1 "
                          "WHERE id = :id"), {"id": run.id})
    with engine.begin() as conn, pytest.raises(LeaseLost):
        app.start_run(conn, square, idempotency_key="k", checkpoint=Item(n=1),
                      parent=job.on(conn))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outboxkit.agent_runs "
                                 "WHERE parent_id = :id"), {"id": run.id}).scalar_one() == 0
