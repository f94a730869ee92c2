"""Leases fence every write: concurrent claims never double up, a taken-over worker writes
nothing (real PostgreSQL)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest
from sqlalchemy import Engine, insert, select

from outbox.db.tables import agent_runs, run_transitions
from outbox.errors import LeaseLost
from outbox.runs import lifecycle as runs
from outbox.runs import steps
from outbox.runs.states import RunState


def test_two_worker_threads_racing_for_200_runs_claim_each_exactly_once(
        runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        conn.execute(insert(agent_runs), [
            {"id": uuid.uuid4(), "workflow": "race", "workflow_version": "1", "state": "queued",
             "idempotency_key": f"race-{i}"} for i in range(200)])
    claimed: dict[str, list[uuid.UUID]] = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def worker(name: str) -> None:
        barrier.wait()
        while True:
            with runs_engine.begin() as conn:
                got = runs.claim(conn, worker=name, lease_seconds=60)
                if got is None:
                    return
                claimed[name].append(got.run.id)
                runs.transition(conn, got.lease, "done", evidence={"by": name})

    threads = [threading.Thread(target=worker, args=(n,)) for n in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    every = claimed["a"] + claimed["b"]
    assert len(every) == 200
    assert len(set(every)) == 200
    assert claimed["a"]
    assert claimed["b"]  # both really competed
    with runs_engine.connect() as conn:
        states = Counter(conn.execute(select(agent_runs.c.state)).scalars())
        claims = Counter(conn.execute(select(run_transitions.c.run_id)
                                      .where(run_transitions.c.to_state == "running")).scalars())
    assert states == {"done": 200}
    assert set(claims.values()) == {1}


@pytest.fixture
def taken_over(runs_engine: Engine):
    """Worker A claimed a run with a short lease; it expired and worker B took the run."""
    with runs_engine.begin() as conn:
        run = runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k",
                             checkpoint={"step": 0})
    with runs_engine.begin() as conn:
        a = runs.claim(conn, worker="A", lease_seconds=0.2)
    assert a is not None
    time.sleep(0.3)
    with runs_engine.begin() as conn:
        b = runs.claim(conn, worker="B", lease_seconds=60)
    assert b is not None
    assert b.run.id == run.id
    return a, b


def test_a_takeover_keeps_the_run_running_and_says_so_in_the_history(
        runs_engine: Engine, taken_over) -> None:
    a, b = taken_over
    assert b.run.state is RunState.RUNNING
    assert b.lease.token == a.lease.token + 1
    with runs_engine.connect() as conn:
        last = runs.history(conn, b.run.id)[-1]
    assert (last.from_state, last.to_state, last.actor) == ("running", "running", "B")
    assert last.reason == "lease expired, resumed by B"


@pytest.mark.parametrize("write", ["transition", "checkpoint", "record", "run_step", "renew",
                                   "release"])
def test_the_worker_whose_lease_was_taken_over_can_write_nothing(
        runs_engine: Engine, taken_over, snapshot, write: str) -> None:
    a, _ = taken_over
    lease = a.lease
    calls: list[str] = []
    before = snapshot()
    attempts = {
        "transition": lambda conn: runs.transition(conn, lease, "done", evidence={"stale": 1}),
        "checkpoint": lambda conn: runs.save_checkpoint(conn, lease, {"step": 99}),
        "record": lambda conn: steps.record(conn, lease, "s1", {"stale": True}),
        "run_step": lambda conn: steps.run_step(conn, lease, "s1",
                                                lambda: calls.append("tool") or 1),
        "renew": lambda conn: runs.renew(conn, lease, 60),
        "release": lambda conn: runs.release(conn, lease),
    }
    with runs_engine.begin() as conn, pytest.raises(LeaseLost) as caught:
        attempts[write](conn)
    assert caught.value.run_id == lease.run_id
    assert caught.value.held_token == lease.token
    assert snapshot() == before
    assert calls == []  # the stale worker did not even call the tool


def test_an_old_lease_object_of_the_same_worker_is_refused(runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        got = runs.claim(conn, worker="A", lease_seconds=60)
        assert got is not None
        newer = runs.save_checkpoint(conn, got.lease, {"n": 1})
        assert newer.version == got.lease.version + 1
        with pytest.raises(LeaseLost):
            runs.save_checkpoint(conn, got.lease, {"n": 2})
        assert runs.get_run(conn, got.run.id).checkpoint == {"n": 1}


def test_renew_extends_the_lease_from_the_database_clock(runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        got = runs.claim(conn, worker="A", lease_seconds=5)
    assert got is not None
    with runs_engine.begin() as conn:
        renewed = runs.renew(conn, got.lease, 600)
    assert (renewed.expires_at - got.lease.expires_at).total_seconds() > 590


def test_released_run_is_claimable_at_once_by_another_worker(runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        got = runs.claim(conn, worker="A", lease_seconds=600)
        assert got is not None
        runs.release(conn, got.lease)
    with runs_engine.begin() as conn:
        again = runs.claim(conn, worker="B", lease_seconds=60)
    assert again is not None
    assert again.lease.token == 2
