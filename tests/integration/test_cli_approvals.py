"""`outbox approvals`: a person sees what runs wait for, grants or revokes it (real PostgreSQL)."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import Engine

from outbox import Envelope, call_digest
from outbox.handle import claim
from outbox.runs.approvals import request_approval
from outbox.runs.lifecycle import get_run, start_run, transition
from outbox.runs.states import RunState
from tests.integration.cli_support import one_line, outbox


def _waiting_run(engine: Engine, key: str, expires: timedelta) -> tuple[uuid.UUID, uuid.UUID]:
    with engine.begin() as conn:
        start_run(conn, workflow="support", workflow_version="1", idempotency_key=key)
    with engine.begin() as conn:
        job = claim(conn, worker="w", lease_seconds=30)
        assert job is not None
        approval = request_approval(conn, job.run.id, scope={"tool": "reorder", "qty": 3},
                                    expires_at=expires, reason="tool reorder needs approval")
        job.transition("waiting", step="approval:reorder")
    return job.run.id, approval.id


@pytest.fixture
def waiting(engine: Engine) -> tuple[uuid.UUID, uuid.UUID]:
    return _waiting_run(engine, "t-1", timedelta(hours=1))


def test_list_shows_pending_approvals_and_grant_wakes_the_run(
        waiting: tuple[uuid.UUID, uuid.UUID], engine: Engine, database_url: str) -> None:
    run_id, approval_id = waiting
    listed = outbox("approvals", "list", "--pending", "--json", "--database-url", database_url)
    assert listed.returncode == 0, listed.stderr
    assert [(a["id"], a["run_id"], a["scope"]) for a in json.loads(listed.stdout)] == [
        (str(approval_id), str(run_id), {"tool": "reorder", "qty": 3})]
    table = outbox("approvals", "list", "--database-url", database_url)
    assert "pending" in table.stdout
    assert str(approval_id) in table.stdout
    granted = outbox("approvals", "grant", str(approval_id), "--by", "alice",
                     "--database-url", database_url)
    assert granted.returncode == 0, granted.stderr
    assert f"run {run_id} wakes" in granted.stdout
    with engine.connect() as conn:
        run = get_run(conn, run_id)
    assert run.state is RunState.WAITING
    assert run.not_before is not None  # due now: the next claim takes it
    still = outbox("approvals", "list", "--pending", "--json", "--database-url", database_url)
    assert json.loads(still.stdout) == []
    with engine.begin() as conn:
        job = claim(conn, worker="w2", lease_seconds=30)
        assert job is not None
        assert job.run.id == run_id
        assert job.revalidate(approval_id, scope={"tool": "reorder", "qty": 3}).valid
        transition(conn, job.lease, "done", evidence={"ok": True})


def test_revoke_records_who_and_why_and_the_run_goes_to_a_person(
        waiting: tuple[uuid.UUID, uuid.UUID], engine: Engine, database_url: str) -> None:
    run_id, approval_id = waiting
    revoked = outbox("approvals", "revoke", str(approval_id), "--by", "bob",
                     "--reason", "supplier on hold", "--database-url", database_url)
    assert revoked.returncode == 0, revoked.stderr
    listed = outbox("approvals", "list", "--run", str(run_id), "--json",
                    "--database-url", database_url)
    [approval] = json.loads(listed.stdout)
    assert (approval["revoked_by"], approval["reason"]) == ("bob", "supplier on hold")
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outboxkit.agent_runs SET not_before = now()")
    with engine.begin() as conn:
        job = claim(conn, worker="w2", lease_seconds=30)
        assert job is not None
        check = job.revalidate(approval_id, scope={"tool": "reorder", "qty": 3})
    assert (check.valid, check.state) == (False, RunState.NEEDS_HUMAN)
    assert "supplier on hold" in (check.reason or "")


def test_granting_an_expired_or_unknown_approval_is_one_line_and_changes_nothing(
        engine: Engine, database_url: str) -> None:
    _, approval_id = _waiting_run(engine, "t-2", timedelta(seconds=-1))
    expired = outbox("approvals", "grant", str(approval_id), "--by", "alice",
                     "--database-url", database_url)
    assert expired.returncode == 1
    assert "expired" in one_line(expired)
    unknown = outbox("approvals", "grant", str(uuid.uuid4()), "--by", "alice",
                     "--database-url", database_url)
    assert unknown.returncode == 1
    assert "no such approval" in one_line(unknown)
    nobody = outbox("approvals", "grant", str(approval_id), "--by", "",
                    "--database-url", database_url)
    assert nobody.returncode == 2


def test_grant_records_why_and_the_audit_shows_the_call_who_why_and_its_message(
        engine: Engine, database_url: str) -> None:
    args = {"item": "bolt M6", "qty": 3}
    digest = call_digest("reorder", args)
    with engine.begin() as conn:
        start_run(conn, workflow="support", workflow_version="1", idempotency_key="t-3")
    empty = outbox("approvals", "audit", "--database-url", database_url)
    assert (empty.returncode, empty.stdout) == (0, "no approval bound to a call\n")
    with engine.begin() as conn:
        job = claim(conn, worker="w", lease_seconds=30)
        assert job is not None
        approval = request_approval(conn, job.run.id, scope={"tool": "reorder", "args": args},
                                    expires_at=timedelta(hours=1), digest=digest)
        job.transition("waiting", step="approval:reorder")
    granted = outbox("approvals", "grant", str(approval.id), "--by", "alice",
                     "--reason", "stock is out", "--database-url", database_url)
    assert granted.returncode == 0, granted.stderr
    with engine.begin() as conn:
        job = claim(conn, worker="w2", lease_seconds=30)
        assert job is not None
        message_id = job.emit(Envelope(topic="supplier.orders", type="order.place",
                                       key="acme", payload=args))
        job.spend_approval(approval.id, digest=digest, message_id=message_id)
        job.transition("done", evidence={"sent": str(message_id)})
    table = outbox("approvals", "audit", "--database-url", database_url)
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split() == ["approval", "run", "call", "granted", "why", "revoked",
                              "spent", "on"]
    for shown in (str(approval.id), str(job.run.id), 'reorder{"item":"bolt M6","qty":3}',
                  "alice", "stock is out", f"message {message_id} at",
                  "(supplier.orders, key acme)"):
        assert shown in row, shown
    listed = outbox("approvals", "audit", "--run", str(job.run.id), "--json",
                    "--database-url", database_url)
    [entry] = json.loads(listed.stdout)
    assert (entry["approval_id"], entry["tool"], entry["args"], entry["digest"]) == (
        str(approval.id), "reorder", args, digest)
    assert (entry["granted_by"], entry["grant_reason"]) == ("alice", "stock is out")
    assert (entry["spent_message_id"], entry["topic"], entry["key"]) == (
        str(message_id), "supplier.orders", "acme")
    other = outbox("approvals", "audit", "--run", str(uuid.uuid4()), "--json",
                   "--database-url", database_url)
    assert json.loads(other.stdout) == []
    refused = outbox("approvals", "revoke", str(approval.id), "--by", "bob", "--reason", "late",
                     "--database-url", database_url)
    assert refused.returncode == 1
    assert f"already spent on message {message_id}" in one_line(refused)
