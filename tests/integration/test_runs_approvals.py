"""Approvals are revalidated on resume: expired, revoked or out of scope → needs-human."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from outbox.errors import ApprovalInvalid, RunNotFound
from outbox.runs import approvals
from outbox.runs import lifecycle as runs
from outbox.runs.states import RunState


def _waiting_for_approval(engine: Engine, expires: timedelta) -> approvals.Approval:
    with engine.begin() as conn:
        runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        got = runs.claim(conn, worker="w", lease_seconds=60)
        assert got is not None
        approval = approvals.request_approval(conn, got.run.id, expires_at=expires,
                                              scope={"tool": "pay", "max": 100})
        runs.transition(conn, got.lease, "waiting", reason="needs approval")
    return approval


def _resume(engine: Engine, approval: approvals.Approval,
            scope: dict[str, object]) -> approvals.ApprovalCheck:
    with engine.begin() as conn:
        got = runs.claim(conn, worker="w2", lease_seconds=60)
        assert got is not None
        return approvals.revalidate(conn, got.lease, approval.id, scope=scope)


def _state(engine: Engine, approval: approvals.Approval) -> runs.Run:
    with engine.connect() as conn:
        return runs.get_run(conn, approval.run_id)


def test_granting_wakes_the_run_and_a_valid_approval_lets_it_continue(
        runs_engine: Engine) -> None:
    approval = _waiting_for_approval(runs_engine, timedelta(hours=1))
    with runs_engine.begin() as conn:
        assert runs.claim(conn, worker="w2", lease_seconds=60) is None  # still waiting
        granted = approvals.grant(conn, approval.id, by="alice")
    assert granted.granted_by == "alice"
    check = _resume(runs_engine, approval, {"tool": "pay", "max": 100})
    assert check.valid
    assert _state(runs_engine, approval).state is RunState.RUNNING


def test_an_approval_that_expired_before_resume_sends_the_run_to_needs_human(
        runs_engine: Engine) -> None:
    approval = _waiting_for_approval(runs_engine, timedelta(seconds=0.5))
    with runs_engine.begin() as conn:
        approvals.grant(conn, approval.id, by="alice")
    time.sleep(0.6)
    check = _resume(runs_engine, approval, {"tool": "pay"})
    assert not check.valid
    assert check.state is RunState.NEEDS_HUMAN
    run = _state(runs_engine, approval)
    assert run.state is RunState.NEEDS_HUMAN
    assert run.reason is not None
    assert "expired" in run.reason


def test_a_revoked_approval_sends_the_run_to_needs_human(runs_engine: Engine) -> None:
    approval = _waiting_for_approval(runs_engine, timedelta(hours=1))
    with runs_engine.begin() as conn:
        approvals.grant(conn, approval.id, by="alice")
        approvals.revoke(conn, approval.id, by="bob", reason="supplier changed")
    check = _resume(runs_engine, approval, {"tool": "pay"})
    assert check.state is RunState.NEEDS_HUMAN
    assert check.reason == f"approval {approval.id} was revoked by bob: supplier changed"
    with runs_engine.connect() as conn:
        last = runs.history(conn, approval.run_id)[-1]
    assert last.to_state == "needs-human"
    assert last.evidence["problem"] == "was revoked by bob: supplier changed"


def test_an_out_of_scope_use_sends_the_run_to_needs_human(runs_engine: Engine) -> None:
    approval = _waiting_for_approval(runs_engine, timedelta(hours=1))
    with runs_engine.begin() as conn:
        approvals.grant(conn, approval.id, by="alice")
    check = _resume(runs_engine, approval, {"tool": "pay", "max": 5000})
    assert check.state is RunState.NEEDS_HUMAN
    assert _state(runs_engine, approval).state is RunState.NEEDS_HUMAN


def test_a_pending_approval_puts_the_run_back_to_waiting(runs_engine: Engine) -> None:
    approval = _waiting_for_approval(runs_engine, timedelta(hours=1))
    with runs_engine.begin() as conn:
        runs.wake(conn, approval.run_id)  # a timer woke it before anyone decided
    check = _resume(runs_engine, approval, {"tool": "pay"})
    assert check.state is RunState.WAITING
    assert _state(runs_engine, approval).not_before == approval.expires_at


def test_an_expired_or_revoked_approval_cannot_be_granted(runs_engine: Engine) -> None:
    approval = _waiting_for_approval(runs_engine, timedelta(hours=1))
    with runs_engine.begin() as conn:
        approvals.revoke(conn, approval.id, by="bob")
    with runs_engine.begin() as conn, pytest.raises(ApprovalInvalid, match="revoked"):
        approvals.grant(conn, approval.id, by="alice")


def test_an_approval_for_an_unknown_run_is_refused_and_the_transaction_goes_on(
    runs_engine: Engine,
) -> None:
    missing = uuid.uuid4()
    with runs_engine.begin() as conn:
        with pytest.raises(RunNotFound) as caught:
            approvals.request_approval(conn, missing, scope={"spend": 10},
                                       expires_at=timedelta(minutes=5))
        assert caught.value.run_id == missing
        # The transaction is still usable: no foreign-key error aborted it.
        assert conn.execute(text("SELECT count(*) FROM outboxkit.approvals")).scalar_one() == 0


def test_an_approval_with_an_absolute_expiry_is_stored_as_given(runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        run = runs.start_run(conn, workflow="w", workflow_version="1", idempotency_key="abs")
        until = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
        approval = approvals.request_approval(conn, run.id, scope={"a": 1}, expires_at=until)
    assert approval.expires_at == until
    assert approval.scope == {"a": 1}
