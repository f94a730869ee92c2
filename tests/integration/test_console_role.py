"""The console as a least-privileged database role (console.roles.console_grants): every
page and every action works with those grants, and the role can delete nothing and cannot
touch what belongs to the relays and the consumers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from console.roles import console_grants
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from outbox.runs.approvals import request_approval
from outbox.runs.lifecycle import get_run, start_run
from tests.integration.cli_support import refuse
from tests.integration.console_support import LEDGER, call, serving, unknown_order
from tests.integration.operations_support import waiting_run


@pytest.fixture(params=[False, True], ids=["reads-and-acts", "and-replays"])
def console_url(database_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    role = f"console_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'console-pw'")  # type: ignore[arg-type]
        conn.execute(console_grants("outboxkit", role,  # type: ignore[arg-type]
                                    replay=request.param))
    host_and_db = database_url.split("@", 1)[1]
    yield f"postgresql://{role}:console-pw@{host_and_db}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
        conn.execute(f"DROP ROLE {role}")  # type: ignore[arg-type]


def test_every_page_and_action_works_with_the_consoles_grants(
        console_url: str, engine: Engine) -> None:
    run_id, op_id = unknown_order(engine, "priv")
    approval_run = waiting_run(engine, "priv-approval")
    with engine.begin() as conn:
        approval = request_approval(conn, approval_run, scope={"tool": "refund"},
                                    expires_at=timedelta(hours=1))
        other = request_approval(conn, approval_run, scope={"tool": "refund", "n": 2},
                                 expires_at=timedelta(hours=1))
        emit(conn, Envelope(topic="t", type="t", key="k", payload={}))
        row = conn.execute(text("SELECT max(id) FROM outboxkit.outbox_messages")).scalar_one()
        refuse(conn, row, error="too large")
        failed = start_run(conn, workflow="wf", workflow_version="1", idempotency_key="p-f")
        conn.execute(text("UPDATE outboxkit.agent_runs SET state = 'failed' WHERE id = :i"),
                     {"i": failed.id})
        doomed = start_run(conn, workflow="wf", workflow_version="1", idempotency_key="p-c")
    with serving(console_url) as base:
        for path in ("/", "/inbox", "/runs", f"/runs/{run_id}", f"/runs/{run_id}/events",
                     "/messages", "/messages?failures=retrying"):
            page = call(base, path, as_json=True)
            assert page.status == 200, (path, page.body)
        said = [call(base, path, body=body) for path, body in (
            (f"/operations/{op_id}/resolve", {"outcome": "confirmed",
                                              "evidence": '{"reference": "PO-1"}'}),
            (f"/approvals/{approval.id}/grant", {}),
            (f"/approvals/{other.id}/revoke", {"reason": "no"}),
            (f"/runs/{failed.id}/requeue", {"reason": "fixed"}),
            (f"/runs/{doomed.id}/cancel", {"reason": "not wanted"}),
            ("/messages/retry", {"ids": [row]}),
        )]
    assert [a.status for a in said] == [200] * 6, [a.body for a in said]
    with engine.connect() as conn:
        assert get_run(conn, run_id).state.value == "done"
        assert LEDGER.get_operation(conn, op_id).status.value == "confirmed"
        assert get_run(conn, failed.id).state.value == "queued"
        assert get_run(conn, doomed.id).state.value == "failed"


@pytest.mark.parametrize("statement", [
    "DELETE FROM outboxkit.agent_runs",
    "DELETE FROM outboxkit.outbox_messages",
    "UPDATE outboxkit.relay_lanes SET owner = 'me'",
    "TRUNCATE outboxkit.consumer_inbox",
    "DELETE FROM outboxkit.consumer_failures",
    "INSERT INTO outboxkit.outbox_messages (message_id, topic, lane, message_type, payload)"
    " VALUES (gen_random_uuid(), 't', 0, 't', '')",
])
def test_the_console_role_cannot(console_url: str, statement: str) -> None:
    with (psycopg.connect(console_url) as conn,
          pytest.raises(psycopg.errors.InsufficientPrivilege)):
        conn.execute(statement)  # type: ignore[arg-type]


def test_a_grant_missing_is_a_clear_page_not_a_stack_trace(console_url: str, database_url: str,
                                                           engine: Engine) -> None:
    _, op_id = unknown_order(engine, "no-grant")
    role = console_url.split("://", 1)[1].split(":", 1)[0]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"REVOKE SELECT ON outboxkit.operations FROM {role}")  # type: ignore[arg-type]
    with serving(console_url) as base:
        page = call(base, "/inbox")
        answer = call(base, f"/operations/{op_id}/resolve", body={"outcome": "not-applied",
                                                                  "reason": "x"})
    assert page.status == 500
    assert "permission denied for table operations" in page.body
    assert "Traceback" not in page.body
    assert answer.status == 500
    assert "permission denied" in answer.json()["error"]
    with engine.connect() as conn:
        assert LEDGER.get_operation(conn, op_id).status.value == "needs-human"


def test_replaying_needs_its_own_grants(database_url: str, engine: Engine, kafka_bootstrap: str,
                                        kafka_topic: Any) -> None:
    from tests.integration.test_cli_dlq import dead_letter  # noqa: PLC0415

    topic = kafka_topic()
    with engine.begin() as conn:
        first, _ = dead_letter(conn, topic, 1, "a")
        second, _ = dead_letter(conn, topic, 2, "b")
    answers = {}
    for replay, failure_id in ((False, first), (True, second)):
        role = f"console_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")  # type: ignore[arg-type]
            conn.execute(console_grants("outboxkit", role,  # type: ignore[arg-type]
                                        replay=replay))
        url = f"postgresql://{role}:pw@{database_url.split('@', 1)[1]}"
        try:
            with serving(url, kafka_bootstrap=kafka_bootstrap) as base:
                answers[replay] = call(base, f"/failures/{failure_id}/replay", body={})
        finally:
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
                conn.execute(f"DROP ROLE {role}")  # type: ignore[arg-type]
    assert answers[False].status == 500
    assert "permission denied" in answers[False].json()["error"]
    assert answers[True].status == 200, answers[True].body
