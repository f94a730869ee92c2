"""A worker process killed mid-run: nothing half-done is visible, the next worker resumes at
the next step, and a committed step's tool call is not repeated (real PostgreSQL)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, select

from outbox.db.dsn import sqlalchemy_url
from outbox.db.tables import step_results
from outbox.runs import lifecycle as runs
from outbox.runs import steps

WORKER = Path(__file__).with_name("runs_crash_worker.py")


@pytest.fixture
def db(database_url: str):
    engine = create_engine(sqlalchemy_url(database_url))
    with engine.begin() as conn:
        run = runs.start_run(
            conn,
            workflow="wf",
            workflow_version="1",
            idempotency_key="k",
            checkpoint={"after": None},
        )
    yield engine, run.id
    engine.dispose()


def _crash(database_url: str, calls: Path, mode: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(WORKER), database_url, str(calls), mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def _resume(engine: Engine, calls: Path) -> tuple[runs.Claim, list[bool]]:
    time.sleep(1.1)  # the dead worker's 1 s lease runs out
    with engine.begin() as conn:
        got = runs.claim(conn, worker="survivor", lease_seconds=60)
        assert got is not None
        replays = []
        lease = got.lease
        for key in ("s1", "s2"):

            def call(key: str = key) -> dict[str, str]:
                with calls.open("a") as f:
                    f.write(key + "\n")
                return {"result": f"{key}-ok"}

            step = steps.run_step(conn, lease, key, call, checkpoint={"after": key})
            lease = step.lease
            replays.append(step.replayed)
        runs.transition(conn, lease, "done", evidence={"steps": 2})
    return got, replays


def test_a_kill_inside_the_step_transaction_leaves_nothing_of_the_step(
    database_url: str, db, tmp_path: Path
) -> None:
    engine, run_id = db
    calls = tmp_path / "calls"
    _crash(database_url, calls, "in-step")
    with engine.connect() as conn:
        run = runs.get_run(conn, run_id)
        assert conn.execute(select(step_results)).all() == []
    assert run.step is None
    assert run.checkpoint == {"after": None}
    assert calls.read_text().split() == ["s1"]  # the effect happened, its record did not
    got, replays = _resume(engine, calls)
    assert got.run.step is None  # resumes at s1: it was never confirmed
    assert replays == [False, False]
    assert calls.read_text().split() == ["s1", "s1", "s2"]


def test_a_kill_between_steps_resumes_at_the_next_step_without_repeating_the_first(
    database_url: str, db, tmp_path: Path
) -> None:
    engine, run_id = db
    calls = tmp_path / "calls"
    _crash(database_url, calls, "between")
    got, replays = _resume(engine, calls)
    assert got.run.step == "s1"
    assert got.run.checkpoint == {"after": "s1"}
    assert replays == [True, False]
    assert calls.read_text().split() == ["s1", "s2"]  # s1's tool ran exactly once
    with engine.connect() as conn:
        history = runs.history(conn, run_id)
        assert runs.get_run(conn, run_id).state == "done"
    assert [h.reason for h in history if h.to_state == "running"] == [
        "claimed by doomed",
        "lease expired, resumed by survivor",
    ]
