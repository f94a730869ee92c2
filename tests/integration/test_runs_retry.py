"""Retries are decided by policy, bounded, and visible in the history (real PostgreSQL)."""

from __future__ import annotations

import random

from sqlalchemy import Engine, func, select

from outbox.db.tables import agent_runs
from outbox.runs import lifecycle as runs
from outbox.runs import retry
from outbox.runs.states import RunState


class Timeout(Exception):
    pass


class BadRequest(Exception):
    pass


def _claimed(engine: Engine) -> runs.Claim | None:
    with engine.begin() as conn:
        return runs.claim(conn, worker="w", lease_seconds=60)


def _start(engine: Engine) -> runs.Run:
    with engine.begin() as conn:
        return runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")


def test_retryable_errors_requeue_until_max_attempts_then_the_declared_terminal_state(
        runs_engine: Engine) -> None:
    policy = retry.RetryPolicy(max_attempts=3, initial_backoff=0, retryable=(Timeout,),
                               give_up_state=RunState.NEEDS_HUMAN)
    run = _start(runs_engine)
    outcomes = []
    for _ in range(10):  # bounded: the policy must stop it well before
        got = _claimed(runs_engine)
        if got is None:
            break
        with runs_engine.begin() as conn:
            outcomes.append(retry.handle_failure(conn, got.lease, Timeout("slow"),
                                                 policy=policy, step="fetch"))
    assert [(o.state, o.attempts) for o in outcomes] == [
        (RunState.QUEUED, 1), (RunState.QUEUED, 2), (RunState.NEEDS_HUMAN, 3)]
    with runs_engine.connect() as conn:
        stored = runs.get_run(conn, run.id)
        moves = [(h.from_state, h.to_state) for h in runs.history(conn, run.id)
                 if h.from_state != h.to_state]
        attempts = [h.evidence["attempt"] for h in runs.history(conn, run.id)
                    if h.to_state == "failed"]
    assert stored.state is RunState.NEEDS_HUMAN
    assert stored.attempts == 3
    assert stored.last_evidence["error"] == "Timeout"
    assert moves == [(None, "queued")] + [("queued", "running"), ("running", "failed"),
                                          ("failed", "queued")] * 2 + [
        ("queued", "running"), ("running", "needs-human")]
    assert attempts == [1, 2]


def test_a_requeue_waits_for_the_backoff_on_the_database_clock(runs_engine: Engine) -> None:
    policy = retry.RetryPolicy(initial_backoff=30, jitter=0)
    _start(runs_engine)
    got = _claimed(runs_engine)
    assert got is not None
    with runs_engine.begin() as conn:
        failure = retry.handle_failure(conn, got.lease, Timeout("x"), policy=policy)
        wait = conn.execute(select(agent_runs.c.not_before - func.now())).scalar_one()
    assert failure.delay == 30
    assert 29 < wait.total_seconds() <= 30
    assert _claimed(runs_engine) is None


def test_a_final_error_goes_to_the_terminal_state_at_once(runs_engine: Engine) -> None:
    policy = retry.RetryPolicy(max_attempts=5, retryable=(Timeout,), final=(BadRequest,))
    run = _start(runs_engine)
    got = _claimed(runs_engine)
    assert got is not None
    with runs_engine.begin() as conn:
        failure = retry.handle_failure(conn, got.lease, BadRequest("no such sku"),
                                       policy=policy, rng=random.Random(1))
    assert (failure.state, failure.attempts, failure.delay) == (RunState.FAILED, 1, None)
    with runs_engine.connect() as conn:
        stored = runs.get_run(conn, run.id)
    assert stored.state is RunState.FAILED
    assert stored.finished_at is not None
    assert stored.last_evidence == {"error": "BadRequest", "message": "no such sku",
                                    "attempt": 1, "retryable": False}
