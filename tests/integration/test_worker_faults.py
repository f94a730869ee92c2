"""The worker under faults against real PostgreSQL: a migrate= that raises, runs set aside by
the version policy, a step that raises SystemExit or another database's error, its own
connection lost during a step, a read-only server and an unexpected claim error. None of
them may end the worker or stall the runs behind them."""

from __future__ import annotations

import logging
import sys
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox import App, ClaimedRun, RetryPolicy, VersionPolicy
from outbox.aio import AsyncClaimedRun
from outbox.runs.lifecycle import MAX_POLICY_SKIPS, get_run, history, start_run
from tests.integration.worker_support import run_in, running, wait_for


def _old_then_new(engine: Engine, app: App, fn: Any, old: int) -> tuple[list[Any], Any]:
    """*old* runs pinned to version 1, then one of the registered version: claims go in
    created_at order, so the old ones come first."""
    with engine.begin() as conn:
        olds = [start_run(conn, workflow="wf", workflow_version="1", idempotency_key=f"old{i}")
                for i in range(old)]
    with engine.begin() as conn:
        new = app.start_run(conn, fn, idempotency_key="new")
    return olds, new


class TestVersionPolicyFaults:
    def test_a_migrate_that_raises_sends_its_run_to_needs_human_and_the_worker_goes_on(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        def migrate(checkpoint: Any, version: str) -> Any:
            raise KeyError("old checkpoint lacks 'qty'")

        @app.workflow("wf", version="2", on_version_change=VersionPolicy.MIGRATE,
                      migrate=migrate)
        def v2(job: ClaimedRun[Any]) -> None:
            return None

        (old,), new = _old_then_new(engine, app, v2, 1)
        with running(app) as worker:
            run_in(engine, new.id, "done")
            assert worker.ready
        parked = run_in(engine, old.id, "needs-human", timeout=1)
        assert parked.last_evidence["policy"] == "migrate"
        assert "KeyError" in parked.last_evidence["error"]
        assert "old checkpoint lacks 'qty'" in (parked.reason or "")

    def test_a_migrated_checkpoint_over_the_size_limit_sends_its_run_to_needs_human(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("wf", version="2", on_version_change=VersionPolicy.MIGRATE,
                      migrate=lambda checkpoint, version: {"blob": "x" * 2_000_000})
        def v2(job: ClaimedRun[Any]) -> None:
            return None

        (old,), new = _old_then_new(engine, app, v2, 1)
        with running(app):
            run_in(engine, new.id, "done")
        parked = run_in(engine, old.id, "needs-human", timeout=1)
        assert "CheckpointTooLarge" in parked.last_evidence["error"]

    def test_runs_set_aside_past_the_skip_limit_do_not_stall_a_newer_run(
            self, engine: Engine, database_url: str) -> None:
        """More old runs than one claim moves to needs-human: the worker looks again at
        once instead of sleeping its 30 s poll."""
        app = App(database_url=database_url)

        @app.workflow("wf", version="2")  # needs-review for every other version
        def v2(job: ClaimedRun[Any]) -> None:
            return None

        olds, new = _old_then_new(engine, app, v2, 3 * MAX_POLICY_SKIPS)
        with running(app, poll_seconds=30):
            run_in(engine, new.id, "done", timeout=5)
        with engine.connect() as conn:
            assert {get_run(conn, r.id).state for r in olds} == {"needs-human"}


class TestStepFaults:
    @pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
    def test_a_step_raising_system_exit_fails_its_run_and_the_worker_lives_on(
            self, engine: Engine, database_url: str, is_async: bool) -> None:
        app = App(database_url=database_url)

        if is_async:
            @app.workflow("exits", version="1")
            async def exits_async(job: AsyncClaimedRun[Any]) -> None:
                sys.exit(2)  # a library calling sys.exit, argparse...
            exits: Any = exits_async
        else:
            @app.workflow("exits", version="1")
            def exits_sync(job: ClaimedRun[Any]) -> None:
                sys.exit(2)
            exits = exits_sync

        @app.workflow("fine", version="1")
        def fine(job: ClaimedRun[Any]) -> None:
            return None

        with running(app) as worker:
            with engine.begin() as conn:
                bad = app.start_run(conn, exits, idempotency_key="bad")
            failed = run_in(engine, bad.id, "failed")
            with engine.begin() as conn:
                good = app.start_run(conn, fine, idempotency_key="good")
            run_in(engine, good.id, "done")
            assert worker.ready
        assert failed.last_evidence["error"] == "SystemExit"

    def test_an_operational_error_of_another_database_is_the_steps_failure(
            self, engine: Engine, database_url: str) -> None:
        """Only the step's own connection says "outage": an error of a database the function
        talks to goes to its retry policy (before: dropped as an outage, forever)."""
        app = App(database_url=database_url)

        @app.workflow("elsewhere", version="1", retry=RetryPolicy(max_attempts=1))
        def elsewhere(job: ClaimedRun[Any]) -> None:
            raise psycopg.OperationalError("connection to server at other-db failed")

        with running(app):
            with engine.begin() as conn:
                run = app.start_run(conn, elsewhere, idempotency_key="k")
            failed = run_in(engine, run.id, "failed")
        assert failed.last_evidence["error"] == "OperationalError"
        assert failed.attempts == 1

    def test_its_own_connection_lost_during_a_step_drops_the_step_and_the_run_resumes(
            self, engine: Engine, database_url: str) -> None:
        """An outage during a step (its backend terminated): nothing of it commits, the
        retry policy is not charged, and the run is claimed again once its lease expires."""
        app = App(database_url=database_url)
        calls: list[int] = []

        @app.workflow("cut", version="1")
        def cut(job: ClaimedRun[Any]) -> None:
            calls.append(1)
            if len(calls) == 1:
                job.conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")

        with running(app, lease_seconds=1, poll_seconds=1):
            with engine.begin() as conn:
                run = app.start_run(conn, cut, idempotency_key="k")
            done = run_in(engine, run.id, "done", timeout=15)
        assert len(calls) == 2
        assert done.attempts == 0
        with engine.connect() as conn:
            assert "failed" not in [t.to_state for t in history(conn, run.id)]


class TestClaimFaults:
    def test_a_read_only_database_is_waited_out_not_a_crash(
            self, engine: Engine, database_url: str, postgres_dsn: str,
            caplog: pytest.LogCaptureFixture) -> None:
        """As after a failover to a node not yet writable: the claims fail with SQLSTATE 25006;
        the worker is not ready meanwhile and claims again once it can."""
        app = App(database_url=database_url)

        @app.workflow("wf", version="1")
        def step(job: ClaimedRun[Any]) -> None:
            return None

        name = engine.url.database
        caplog.set_level(logging.INFO, logger="outbox.worker")
        with running(app, poll_seconds=0.2) as worker:
            read_only(postgres_dsn, name, True)
            wait_for(lambda: not worker.ready, what="the worker to notice")
            wait_for(lambda: worker._failures >= 2, what="two attempts")
            read_only(postgres_dsn, name, False)
            wait_for(lambda: worker.ready, timeout=15, what="the worker to be ready again")
            with engine.begin() as conn:
                run = app.start_run(conn, step, idempotency_key="k")
            run_in(engine, run.id, "done")
        events = [getattr(r, "event", None) for r in caplog.records]
        assert "worker.not_ready" in events
        assert "worker.claim_error" not in events  # a known condition, no traceback

    def test_an_unexpected_claim_error_is_logged_and_retried_not_a_crash(
            self, engine: Engine, database_url: str, caplog: pytest.LogCaptureFixture) -> None:
        app = App(database_url=database_url)

        @app.workflow("wf", version="1")
        def step(job: ClaimedRun[Any]) -> None:
            return None

        caplog.set_level(logging.INFO, logger="outbox.worker")
        with running(app, poll_seconds=0.2) as worker:
            with engine.begin() as conn:
                # Every claim's UPDATE now fails with a check violation (23514).
                conn.execute(text("ALTER TABLE outboxkit.agent_runs ADD CONSTRAINT no_claims "
                                  "CHECK (state <> 'running') NOT VALID"))
                run = app.start_run(conn, step, idempotency_key="k")
            wait_for(lambda: worker._failures >= 2, what="two failed claims")
            with engine.begin() as conn:
                conn.execute(text("ALTER TABLE outboxkit.agent_runs DROP CONSTRAINT no_claims"))
            run_in(engine, run.id, "done", timeout=15)
        errors = [r for r in caplog.records if getattr(r, "event", None) == "worker.claim_error"]
        assert len(errors) == 1  # one per streak, with the traceback
        assert errors[0].exc_info is not None


def read_only(dsn: str, database: str | None, on: bool) -> None:
    """Make *database* read-only (or writable again) for new sessions, and end its sessions."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {database} SET default_transaction_read_only = "
                      f"{'on' if on else 'off'}")
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = %s AND pid <> pg_backend_pid()", (database,))
