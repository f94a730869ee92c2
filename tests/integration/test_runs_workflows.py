"""Version policies on resume under other code, and retired workflows (real PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine

from outbox.errors import WorkflowRetired
from outbox.runs import lifecycle as runs
from outbox.runs.states import RunState
from outbox.runs.workflows import VersionPolicy, Workflow, register, retire


def _queued_v1(engine: Engine) -> runs.Run:
    with engine.begin() as conn:
        register(conn, Workflow(name="wf", version="1"))
        return runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k",
                              checkpoint={"total": 10})


def _claim(engine: Engine, code: Workflow) -> runs.Claim | None:
    with engine.begin() as conn:
        register(conn, code)
        return runs.claim(conn, worker="w", lease_seconds=60, workflows=[code])


def test_continue_policy_resumes_under_new_code_and_keeps_the_pinned_version(
        runs_engine: Engine) -> None:
    run = _queued_v1(runs_engine)
    got = _claim(runs_engine, Workflow(name="wf", version="2",
                                       on_version_change=VersionPolicy.CONTINUE))
    assert got is not None
    assert got.run.workflow_version == "1"
    assert got.run.checkpoint == {"total": 10}
    with runs_engine.connect() as conn:
        note = runs.history(conn, run.id)[-1]
    assert note.reason == "continuing under the running code (workflow_version 1 -> 2)"


def test_migrate_policy_upgrades_the_checkpoint_and_the_pinned_version(
        runs_engine: Engine) -> None:
    seen: list[tuple[Any, str]] = []

    def upgrade(checkpoint: Any, from_version: str) -> Any:
        seen.append((checkpoint, from_version))
        return {"total_cents": checkpoint["total"] * 100}

    _queued_v1(runs_engine)
    got = _claim(runs_engine, Workflow(name="wf", version="2", migrate=upgrade,
                                       on_version_change=VersionPolicy.MIGRATE))
    assert got is not None
    assert seen == [({"total": 10}, "1")]
    assert got.run.checkpoint == {"total_cents": 1000}
    assert got.run.workflow_version == "2"
    with runs_engine.begin() as conn:  # the lease returned after the migration still writes
        runs.transition(conn, got.lease, "done", evidence={"ok": True})


def test_needs_review_policy_parks_the_run_for_a_human(runs_engine: Engine) -> None:
    run = _queued_v1(runs_engine)
    got = _claim(runs_engine, Workflow(name="wf", version="2", prompt_version="p2"))
    assert got is None
    with runs_engine.connect() as conn:
        stored = runs.get_run(conn, run.id)
    assert stored.state is RunState.NEEDS_HUMAN
    assert stored.reason is not None
    assert "workflow_version 1 -> 2" in stored.reason
    assert "prompt_version None -> p2" in stored.reason


def test_same_version_is_claimed_untouched(runs_engine: Engine) -> None:
    _queued_v1(runs_engine)
    got = _claim(runs_engine, Workflow(name="wf", version="1"))
    assert got is not None
    assert got.lease.version == 1


class TestRetired:
    def test_runs_of_a_retired_workflow_are_not_claimed(self, runs_engine: Engine) -> None:
        _queued_v1(runs_engine)
        with runs_engine.begin() as conn:
            retire(conn, "wf", reason="replaced by wf2")
            assert runs.claim(conn, worker="w", lease_seconds=60) is None

    def test_a_retired_workflow_starts_no_new_run(self, runs_engine: Engine) -> None:
        with runs_engine.begin() as conn:
            register(conn, Workflow(name="wf", version="1", retired=True,
                                    retired_reason="unsafe prompt"))
        with runs_engine.begin() as conn, pytest.raises(WorkflowRetired, match="unsafe prompt"):
            runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="new")

    def test_a_failed_run_of_a_retired_workflow_cannot_be_requeued(
            self, runs_engine: Engine, snapshot) -> None:
        run = _queued_v1(runs_engine)
        with runs_engine.begin() as conn:
            got = runs.claim(conn, worker="w", lease_seconds=60)
            assert got is not None
            runs.transition(conn, got.lease, "failed", reason="tool down")
            retire(conn, "wf", reason="replaced by wf2")
        before = snapshot()
        with runs_engine.begin() as conn, pytest.raises(WorkflowRetired) as caught:
            runs.move(conn, run.id, "queued", actor="ops")
        assert caught.value.workflow == "wf"
        assert caught.value.reason == "replaced by wf2"
        assert snapshot() == before
