"""The worker as a daemon: ``outbox worker`` stopped by SIGTERM, and a database outage
waited out (on a PostgreSQL cluster of the test's own, which the test stops and restarts)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine

from outbox import App, ClaimedRun
from outbox.db.dsn import sqlalchemy_url
from outbox.db.migrate import migrate
from outbox.testing import postgres
from outbox.testing.postgres import PostgresCluster
from outbox.testing.processes import free_port
from tests.integration import worker_app
from tests.integration.worker_support import run_in, running, wait_for

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = Path(sys.executable).parent / "outbox"


def test_sigterm_lets_the_step_in_flight_finish_and_exits_0(
        engine: Engine, database_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    env = {**os.environ, "OUTBOXKIT_DATABASE_URL": database_url,
           "WORKER_TEST_MARKER": str(marker), "OUTBOXKIT_WORKER_POLL_SECONDS": "30"}
    proc = subprocess.Popen(
        [str(OUTBOX), "worker", "tests.integration.worker_app:app", "--name", "w-term"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with engine.begin() as conn:
            run = worker_app.app.start_run(conn, worker_app.nap, idempotency_key="k",
                                           checkpoint=worker_app.Nap(seconds=1.0))
        wait_for(marker.exists, what="the step to start")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "waiting up to 30 s for 1 in-flight steps" in stderr
    done = run_in(engine, run.id, "done", timeout=1)
    assert done.state == "done"


def test_sigterm_with_a_step_outliving_the_grace_abandons_it_says_so_and_exits_1(
        engine: Engine, database_url: str, tmp_path: Path) -> None:
    """The worker's own grace period ends before the signal handler's deadline, so its
    abandonment runs (and is logged) instead of the process being cut short."""
    marker = tmp_path / "started"
    env = {**os.environ, "OUTBOXKIT_DATABASE_URL": database_url,
           "WORKER_TEST_MARKER": str(marker), "OUTBOXKIT_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}
    proc = subprocess.Popen(
        [str(OUTBOX), "worker", "tests.integration.worker_app:app", "--name", "w-slow"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with engine.begin() as conn:
            run = worker_app.app.start_run(conn, worker_app.nap, idempotency_key="k",
                                           checkpoint=worker_app.Nap(seconds=30))
        wait_for(marker.exists, what="the step to start")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr
    assert "1 steps did not finish within 1 s; abandoned" in stderr
    assert "fencing keeps it single" in stderr
    assert run_in(engine, run.id, "running", timeout=1).state == "running"  # its lease expires


@pytest.fixture
def own_cluster() -> Iterator[PostgresCluster]:
    base = Path(tempfile.mkdtemp(prefix="outboxkit-worker-"))
    base.chmod(0o755)
    try:
        yield postgres.start(base / "pg", free_port())
    finally:
        postgres.stop(base / "pg", grace_s=10)
        shutil.rmtree(base, ignore_errors=True)


def test_a_database_outage_is_one_warning_not_ready_meanwhile_and_work_resumes(
        own_cluster: PostgresCluster, caplog: pytest.LogCaptureFixture) -> None:
    engine = create_engine(sqlalchemy_url(own_cluster.dsn), pool_pre_ping=True)
    migrate(engine)
    app = App(database_url=own_cluster.dsn)

    @app.workflow("wf", version="1")
    def step(job: ClaimedRun[Any]) -> None:
        return None

    caplog.set_level(logging.INFO, logger="outbox.worker")
    try:
        with running(app) as worker:
            postgres.stop(own_cluster.data_dir, grace_s=10)
            wait_for(lambda: not worker.ready, what="the worker to notice the outage")
            # Let it try a few times (0.2 s, 0.4 s, 0.8 s...) before the database is back.
            wait_for(lambda: worker._failures >= 3, what="three reconnect attempts")
            postgres.start(own_cluster.data_dir, own_cluster.port)
            wait_for(lambda: worker.ready and worker.listening, timeout=20,
                     what="the worker to be ready again")
            with engine.begin() as conn:
                run = app.start_run(conn, step, idempotency_key="after")
            run_in(engine, run.id, "done", timeout=10)
    finally:
        engine.dispose()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [getattr(r, "event", None) for r in warnings] == ["worker.not_ready"], \
        [r.getMessage() for r in warnings]
    assert "database unavailable" in warnings[0].getMessage()
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events.count("worker.ready") == 2  # at start, and once the database is back
