"""Runs move only along the allowed table; a refused move writes nothing (real PostgreSQL)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from outbox.db.tables import agent_runs, run_transitions
from outbox.errors import EvidenceRequired, IllegalTransition, LeaseLost, RunError, RunNotFound
from outbox.runs import lifecycle as runs
from outbox.runs.leases import Lease
from outbox.runs.states import ALLOWED, RunState


def _start(engine: Engine, workflow: str = "wf") -> runs.Run:
    with engine.begin() as conn:
        return runs.start_run(conn, workflow=workflow, workflow_version="1",
                              idempotency_key=str(uuid.uuid4()), checkpoint={"n": 0})


def _claim(engine: Engine, workflow: str = "wf") -> runs.Claim:
    with engine.begin() as conn:
        claimed = runs.claim(conn, worker="w1", lease_seconds=60, workflows=[workflow])
    assert claimed is not None
    return claimed


class TestLifecycle:
    def test_a_run_goes_queued_running_done_with_one_history_row_per_move(
            self, runs_engine: Engine) -> None:
        run = _start(runs_engine)
        claimed = _claim(runs_engine)
        assert claimed.run.id == run.id
        assert claimed.lease.token == 1
        with runs_engine.begin() as conn:
            runs.transition(conn, claimed.lease, "done", evidence={"receipt": "r-1"}, step="end")
        with runs_engine.connect() as conn:
            stored = runs.get_run(conn, run.id)
            rows = runs.history(conn, run.id)
        assert stored.state is RunState.DONE
        assert stored.finished_at is not None
        assert stored.last_evidence == {"receipt": "r-1"}
        assert [(r.from_state, r.to_state) for r in rows] == [
            (None, "queued"), ("queued", "running"), ("running", "done")]
        assert rows[-1].evidence == {"receipt": "r-1"}
        assert rows[-1].step == "end"

    def test_done_without_evidence_is_refused_and_writes_nothing(
            self, runs_engine: Engine, snapshot) -> None:
        _start(runs_engine)
        claimed = _claim(runs_engine)
        before = snapshot()
        with runs_engine.begin() as conn, pytest.raises(EvidenceRequired):
            runs.transition(conn, claimed.lease, "done")
        assert snapshot() == before

    def test_the_same_idempotency_key_returns_the_existing_run(self, runs_engine: Engine) -> None:
        with runs_engine.begin() as conn:
            first = runs.start_run(conn, workflow="wf", workflow_version="1",
                                   idempotency_key="order-42")
        with runs_engine.begin() as conn:
            again = runs.start_run(conn, workflow="wf", workflow_version="1",
                                   idempotency_key="order-42", checkpoint={"other": True})
        assert again.id == first.id
        assert again.checkpoint is None
        with runs_engine.connect() as conn:
            assert len(conn.execute(select(agent_runs.c.id)).all()) == 1

    def test_a_leased_run_cannot_be_moved_by_an_operator(self, runs_engine: Engine,
                                                         snapshot) -> None:
        run = _start(runs_engine)
        _claim(runs_engine)
        before = snapshot()
        with runs_engine.begin() as conn, pytest.raises(IllegalTransition, match="lease"):
            runs.move(conn, run.id, "needs-human", actor="ops")
        assert snapshot() == before

    def test_moving_an_unknown_run_raises_run_not_found(self, runs_engine: Engine) -> None:
        with runs_engine.begin() as conn, pytest.raises(RunNotFound):
            runs.move(conn, uuid.uuid4(), "queued", actor="ops")

    def test_waiting_run_is_claimed_again_only_after_it_is_woken(
            self, runs_engine: Engine) -> None:
        run = _start(runs_engine)
        claimed = _claim(runs_engine)
        with runs_engine.begin() as conn:
            runs.transition(conn, claimed.lease, "waiting", reason="wait for supplier")
            assert runs.claim(conn, worker="w2", lease_seconds=60) is None
            runs.wake(conn, run.id)
        again = _claim(runs_engine)
        assert again.lease.token == 2
        with runs_engine.connect() as conn:
            assert runs.history(conn, run.id)[-1].reason == "woken, resumed by w1"


# --- property: random sequences of moves against the real database --------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.none()),
        st.tuples(st.just("wake"), st.none()),
        st.tuples(st.just("transition"), st.sampled_from(list(RunState))),
        st.tuples(st.just("transition_no_evidence"), st.just(RunState.DONE)),
        st.tuples(st.just("stale"), st.sampled_from(list(RunState))),
        st.tuples(st.just("move"), st.sampled_from(list(RunState))),
    ),
    max_size=12,
)


@dataclass
class Model:
    state: RunState = RunState.QUEUED
    token: int = 0
    version: int = 0
    woken: bool = False
    history: int = 1


def _apply(engine: Engine, run_id: uuid.UUID, workflow: str, op: str, to: RunState | None, *,
           lease: Lease | None, first: Lease | None) -> Lease | None:
    """Apply *op* to the database; return the newest lease. Raises RunError when refused."""
    with engine.begin() as conn:
        if op == "claim":
            got = runs.claim(conn, worker="prop", lease_seconds=600, workflows=[workflow])
            return got.lease if got else lease
        if op == "wake":
            runs.wake(conn, run_id)
            return lease
        if op == "move":
            assert to is not None
            runs.move(conn, run_id, to, actor="ops", evidence={"by": "ops"})
            return lease
        held = first if op == "stale" else lease
        if held is None:
            raise LeaseLost(run_id, -1)
        assert to is not None
        evidence = None if op == "transition_no_evidence" else {"ok": True}
        return runs.transition(conn, held, to, evidence=evidence)


def _expect(model: Model, op: str, to: RunState | None, lease: Lease | None,
            first: Lease | None) -> bool:
    """Update *model* if the op must succeed; return whether it must."""
    if op == "claim":
        if model.state is RunState.QUEUED or (model.state is RunState.WAITING and model.woken):
            model.state, model.token, model.woken = RunState.RUNNING, model.token + 1, False
            model.version += 1
            model.history += 1
        return True  # claiming nothing is not an error
    if op == "wake":
        ok = model.state is RunState.WAITING
        if ok:
            model.woken, model.version = True, model.version + 1
        return ok
    assert to is not None
    if op == "move":
        ok = (model.state is not RunState.RUNNING and to is not RunState.RUNNING
              and to in ALLOWED[model.state])
    else:
        held = first if op == "stale" else lease
        ok = (held is not None and model.state is RunState.RUNNING
              and (held.token, held.version) == (model.token, model.version)
              and to in ALLOWED[RunState.RUNNING]
              and op != "transition_no_evidence")
    if ok:
        model.state, model.version, model.history = to, model.version + 1, model.history + 1
        # An operator's move keeps a due wake-up time (not_before) except a requeue, so a
        # woken run moved to needs-human and back to waiting is claimable at once.
        model.woken = model.woken and op == "move" and to is not RunState.QUEUED
    return ok


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
def test_random_move_sequences_keep_the_stored_state_equal_to_the_model(
        runs_engine: Engine, ops: list[tuple[str, RunState | None]]) -> None:
    workflow = f"prop-{uuid.uuid4().hex[:8]}"
    run_id = _start(runs_engine, workflow).id
    model, lease, first = Model(), None, None
    for op, to in ops:
        must_succeed = _expect(model, op, to, lease=lease, first=first)
        try:
            lease = _apply(runs_engine, run_id, workflow, op, to, lease=lease, first=first)
            refused = False
        except RunError:
            refused = True
        if op == "claim" and lease is not None and first is None:
            first = lease
        assert refused is not must_succeed, (op, to, model)
        with runs_engine.connect() as conn:
            row = conn.execute(select(agent_runs.c.state, agent_runs.c.version,
                                      agent_runs.c.lease_token)
                               .where(agent_runs.c.id == run_id)).one()
            count = len(conn.execute(select(run_transitions.c.id)
                                     .where(run_transitions.c.run_id == run_id)).all())
        assert (row.state, row.version, row.lease_token) == (model.state, model.version,
                                                             model.token)
        assert count == model.history
