"""A step's error caught by its RetryPolicy (``catch=``): after the retries, or at once for a
final error, the run goes on at another step with the error as evidence, as Step Functions'
Catch follows its Retry (real PostgreSQL, the worker)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine

from outbox import App, ClaimedRun, RetryPolicy
from outbox.errors import CheckpointInvalid, ConfigurationError
from outbox.runs.lifecycle import history
from tests.integration.worker_support import run_in, running


class Declined(Exception):
    pass


FAST = {"initial_backoff": 0.01, "max_backoff": 0.01, "jitter": 0}


def test_an_error_left_after_the_retries_goes_on_at_the_catch_step(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    steps: list[str | None] = []

    @app.workflow("pay", version="1",
                  retry=RetryPolicy(max_attempts=2, catch={Declined: "refund"}, **FAST))
    def pay(job: ClaimedRun[Any]) -> None:
        steps.append(job.run.step)
        if job.run.step == "refund":
            assert job.run.last_evidence["error"] == "Declined"
            return
        raise Declined("card declined")

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, pay, idempotency_key="k")
        done = run_in(engine, run.id, "done")
    assert steps == [None, None, "refund"]  # two attempts, then the catch step once
    with engine.connect() as conn:
        moves = [(t.to_state, t.step, t.reason) for t in history(conn, run.id)]
    assert ("queued", "refund", "goes on at step 'refund'") in moves
    assert done.step == "refund"


def test_a_final_error_is_caught_at_once_and_a_failing_fallback_gives_up(
        engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)
    steps: list[str | None] = []

    @app.workflow("pay", version="1", retry=RetryPolicy(
        max_attempts=5, final=(Declined,), catch={Declined: "refund"}, **FAST))
    def pay(job: ClaimedRun[Any]) -> None:
        steps.append(job.run.step)
        raise Declined("no")

    with running(app):
        with engine.begin() as conn:
            run = app.start_run(conn, pay, idempotency_key="k")
        failed = run_in(engine, run.id, "failed")
    assert steps == [None, "refund"]  # not retried; the fallback raising the same: gave up
    assert failed.last_evidence["error"] == "Declined"


def test_outboxkits_own_errors_are_never_caught(engine: Engine, database_url: str) -> None:
    app = App(database_url=database_url)

    @app.workflow("pay", version="1",
                  retry=RetryPolicy(catch={Exception: "fallback"}, **FAST))
    def pay(job: ClaimedRun[int]) -> None:
        return None

    with running(app):
        with engine.begin() as conn:  # a checkpoint that is not an int: CheckpointInvalid
            run = app.start_run(conn, "pay", idempotency_key="k", checkpoint=1)
            conn.exec_driver_sql("UPDATE outboxkit.agent_runs SET checkpoint = '\"x\"'")
        failed = run_in(engine, run.id, "failed")
    assert failed.last_evidence["error"] == CheckpointInvalid.__name__
    assert failed.step is None


@pytest.mark.parametrize(("catch", "message"), [
    ({"Declined": "refund"}, "catch keys are exception types"),
    ({Declined: ""}, "must name the step"),
])
def test_a_bad_catch_is_refused_when_the_policy_is_made(catch: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        RetryPolicy(catch=catch)
