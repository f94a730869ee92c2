"""The operator console over real HTTP (uvicorn) against real PostgreSQL: who may read and
act, CSRF, bad input answered clearly with nothing changed, escaping, keyset pages, and each
action settling things exactly as the CLI does."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from dedup.ledger import OperationStatus
from outbox import call_digest
from outbox.runs.approvals import request_approval
from outbox.runs.lifecycle import get_run, start_run
from tests.integration.console_support import (
    LEDGER,
    call,
    csrf_of,
    serving,
    unknown_order,
)
from tests.integration.operations_support import waiting_run


@pytest.fixture
def console(database_url: str) -> Any:
    with serving(database_url, page_size=2) as base:
        yield base


def _state(engine: Engine, run_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return get_run(conn, run_id).state.value


def _op_status(engine: Engine, op_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return LEDGER.get_operation(conn, op_id).status.value


def test_signing_in_is_required_and_a_viewer_reads_but_cannot_act(
        console: str, engine: Engine) -> None:
    run_id, op_id = unknown_order(engine)
    assert call(console, "/", user=None).status == 401
    inbox = call(console, "/inbox", user="vic")
    assert inbox.status == 200
    assert str(op_id) in inbox.body
    assert "It was applied" not in inbox.body  # no forms for a viewer
    refused = call(console, f"/operations/{op_id}/resolve", user="vic",
                   body={"outcome": "confirmed", "evidence": '{"reference": "PO-1"}'})
    assert refused.status == 403
    assert "may only read" in refused.json()["error"]
    assert _op_status(engine, op_id) == "needs-human"
    assert _state(engine, run_id) == "waiting"


def test_a_form_without_the_csrf_token_is_refused_and_changes_nothing(
        console: str, engine: Engine) -> None:
    run_id, op_id = unknown_order(engine)
    form = {"outcome": "confirmed", "evidence": '{"reference": "PO-1"}', "next": "/inbox"}
    for forged in ({}, {"csrf": "0" * 64}):
        answer = call(console, f"/operations/{op_id}/resolve", form={**form, **forged})
        assert answer.status == 403
        assert "CSRF" in answer.body
    assert _op_status(engine, op_id) == "needs-human"
    assert _state(engine, run_id) == "waiting"


def test_an_operator_resolves_an_unknown_outcome_from_the_inbox_and_the_run_is_done(
        console: str, engine: Engine) -> None:
    run_id, op_id = unknown_order(engine)
    page = call(console, "/inbox")
    token = csrf_of(page.body)
    answer = call(console, f"/operations/{op_id}/resolve", form={
        "csrf": token, "next": "/inbox", "outcome": "confirmed",
        "evidence": '{"reference": "PO-77"}', "reason": "the supplier's portal shows it"})
    assert answer.status == 303
    assert answer.headers["location"].startswith("/inbox?said=")
    assert _op_status(engine, op_id) == "confirmed"
    with engine.connect() as conn:
        run = get_run(conn, run_id)
        op = LEDGER.get_operation(conn, op_id)
    assert run.state.value == "done"
    assert run.last_evidence["reference"] == "PO-77"
    assert op.resolved_by == "olga"  # the signed-in operator, as the CLI's --actor
    # Someone else resolved it a second ago: a clear refusal, nothing changed.
    again = call(console, f"/operations/{op_id}/resolve", form={
        "csrf": token, "outcome": "not-applied", "reason": "I think not"})
    assert again.status == 409
    assert "confirmed" in again.body
    assert _op_status(engine, op_id) == "confirmed"


def test_bad_input_gets_a_clear_error_and_nothing_is_written(console: str, engine: Engine
                                                           ) -> None:
    run_id, op_id = unknown_order(engine)
    assert call(console, "/runs/not-a-uuid").status == 400
    missing = call(console, f"/runs/{uuid.uuid4()}", as_json=True)
    assert missing.status == 404
    assert "error" in missing.json()
    assert call(console, "/runs?before=garbage!").status == 400
    assert call(console, "/runs?state=sleeping").status == 400
    for body, said in (({"outcome": "confirmed"}, "evidence is required"),
                       ({"outcome": "confirmed", "evidence": "{not json"}, "not JSON"),
                       ({"outcome": "confirmed", "evidence": "[1]"}, "JSON object"),
                       ({"outcome": "not-applied"}, "reason"),
                       ({"outcome": "maybe"}, "outcome must be")):
        answer = call(console, f"/operations/{op_id}/resolve", body=body)
        assert answer.status == 400, body
        assert said in answer.json()["error"]
    assert _op_status(engine, op_id) == "needs-human"
    assert _state(engine, run_id) == "waiting"


def test_html_in_a_reason_is_shown_as_text(console: str, engine: Engine) -> None:
    with engine.begin() as conn:
        run = start_run(conn, workflow="wf", workflow_version="1", idempotency_key="xss")
        conn.execute(text("UPDATE outboxkit.agent_runs SET reason = :r WHERE id = :i"),
                     {"r": "<script>alert(1)</script>", "i": run.id})
    for path in (f"/runs/{run.id}", "/runs"):
        page = call(console, path)
        assert "<script>alert(1)</script>" not in page.body
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.body
        assert "script-src 'self'" in page.headers["content-security-policy"]


def test_the_runs_list_pages_by_keyset_newest_first_and_filters(console: str, engine: Engine
                                                               ) -> None:
    with engine.begin() as conn:
        made = [start_run(conn, workflow="wf", workflow_version="1",
                          idempotency_key=f"page-{i}").id for i in range(5)]
    seen: list[str] = []
    before = ""
    for _ in range(5):
        page = call(console, f"/runs?before={before}", as_json=True).json()
        seen += [r["id"] for r in page["runs"]]
        if page["next"] is None:
            break
        before = page["next"]
    assert len(seen) == 5
    assert set(seen) == {str(i) for i in made}
    found = call(console, "/runs?q=page-3", as_json=True).json()["runs"]
    assert [r["idempotency_key"] for r in found] == ["page-3"]
    assert call(console, "/runs?state=done", as_json=True).json()["runs"] == []
    assert call(console, "/runs?version=2", as_json=True).json()["runs"] == []
    assert len(call(console, "/runs?version=1&age=1h", as_json=True).json()["runs"]) == 2
    with engine.begin() as conn:
        conn.execute(text("UPDATE outboxkit.agent_runs SET created_at = now() - interval "
                          "'2 days' WHERE idempotency_key LIKE 'page-%'"))
    assert call(console, "/runs?age=1d", as_json=True).json()["runs"] == []
    assert call(console, "/runs?age=forever").status == 400
    html = call(console, "/runs?age=7d&workflow=wf").body  # the pager keeps the filters
    assert all(kept in html for kept in ("age=7d", "workflow=wf", "before="))


def test_an_operator_grants_and_revokes_approvals(console: str, engine: Engine) -> None:
    waiting = waiting_run(engine, "needs-approval")
    with engine.begin() as conn:
        first = request_approval(conn, waiting, scope={"tool": "refund", "amount": 20},
                                 expires_at=timedelta(hours=1))
        second = request_approval(conn, waiting, scope={"tool": "refund", "amount": 900},
                                  expires_at=timedelta(hours=1))
    inbox = call(console, "/inbox")
    assert '&#34;amount&#34;: 900' in inbox.body or "&quot;amount&quot;: 900" in inbox.body \
        or '"amount": 900' in inbox.body
    token = csrf_of(inbox.body)
    granted = call(console, f"/approvals/{first.id}/grant", form={"csrf": token})
    assert (granted.status, granted.headers["location"].split("?")[0]) == (303, "/")
    no_reason = call(console, f"/approvals/{second.id}/revoke", body={})
    assert no_reason.status == 400
    assert call(console, f"/approvals/{second.id}/revoke",
                body={"reason": "too much"}).status == 200
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(text(
            "SELECT id, granted_by, revoked_by FROM outboxkit.approvals"))}
    assert rows[first.id].granted_by == "olga"
    assert rows[second.id].revoked_by == "olga"
    assert call(console, f"/approvals/{second.id}/grant", body={}).status == 409


def test_a_grant_from_the_inbox_records_why_and_is_bound_to_the_call_shown(
        console: str, engine: Engine) -> None:
    """The inbox's grant form carries the digest of the call it shows and a reason: the
    reason is recorded; a grant naming another call is refused and grants nothing."""
    waiting = waiting_run(engine, "bound-approval")
    args = {"order": "PO-7", "amount": 20}
    digest = call_digest("refund", args)
    with engine.begin() as conn:
        bound = request_approval(conn, waiting, scope={"tool": "refund", "args": args},
                                 expires_at=timedelta(hours=1), digest=digest)
    inbox = call(console, "/inbox")
    assert f'name="digest" value="{digest}"' in inbox.body
    forged = call(console, f"/approvals/{bound.id}/grant",
                  body={"digest": call_digest("refund", {**args, "amount": 2000})})
    assert forged.status == 409
    assert "not those the run asks for" in forged.json()["error"]
    token = csrf_of(inbox.body)
    granted = call(console, f"/approvals/{bound.id}/grant",
                   form={"csrf": token, "digest": digest, "reason": "customer called"})
    assert granted.status == 303, granted.body
    with engine.connect() as conn:
        row = conn.execute(text("SELECT granted_by, grant_reason FROM outboxkit.approvals "
                                "WHERE id = :i"), {"i": bound.id}).one()
    assert (row.granted_by, row.grant_reason) == ("olga", "customer called")


def test_requeue_keeps_the_clis_guard(console: str, engine: Engine) -> None:
    run_id, op_id = unknown_order(engine, "rq")
    with engine.begin() as conn:
        conn.execute(text("UPDATE outboxkit.agent_runs SET state = 'needs-human' WHERE id = :i"),
                     {"i": run_id})
    refused = call(console, f"/runs/{run_id}/requeue", body={"reason": "again"})
    assert refused.status == 409
    assert f"operation {op_id}" in refused.json()["error"]
    assert _state(engine, run_id) == "needs-human"
    forced = call(console, f"/runs/{run_id}/requeue", body={"reason": "again", "force": True})
    assert forced.status == 200, forced.body
    assert _state(engine, run_id) == "queued"


def test_the_overview_counts_and_streams_them(console: str, engine: Engine) -> None:
    unknown_order(engine, "o-1")
    unknown_order(engine, "o-2", status="unknown")
    data = call(console, "/", as_json=True).json()
    assert data["runs"]["waiting"] == 2
    assert {k: v for k, v in data["operations"].items() if v} == {"needs-human": 1, "unknown": 1}
    assert data["backlog"] == 0
    page = call(console, "/")
    assert 'data-live="runs.waiting"' in page.body


def test_without_users_the_console_is_read_only(database_url: str, engine: Engine) -> None:
    _, op_id = unknown_order(engine, "ro")
    with serving(database_url, users="") as base:
        assert call(base, "/inbox", user=None).status == 200
        answer = call(base, f"/operations/{op_id}/resolve", user=None,
                      body={"outcome": "not-applied", "reason": "x"})
    assert answer.status == 403
    assert "read-only" in answer.json()["error"]
    assert _op_status(engine, op_id) == OperationStatus.NEEDS_HUMAN.value


def test_after_a_form_the_console_only_sends_you_back_to_itself(console: str, engine: Engine
                                                               ) -> None:
    run_id = waiting_run(engine, "redirect")
    for elsewhere in ("https://evil.example/", "//evil.example/x", "javascript:alert(1)",
                      "/\\evil.example", "/runs"):
        with engine.begin() as conn:  # a fresh one each time: each revoke succeeds
            approval = request_approval(conn, run_id, scope={"tool": "t"},
                                        expires_at=timedelta(hours=1))
        token = csrf_of(call(console, "/inbox").body)
        answer = call(console, f"/approvals/{approval.id}/revoke",
                      form={"csrf": token, "reason": "r", "next": elsewhere})
        assert answer.status == 303, elsewhere
        location = answer.headers["location"]
        expected = "/runs?said=" if elsewhere == "/runs" else "/?said="
        assert location.startswith(expected), (elsewhere, location)


def test_another_host_name_is_refused(console: str) -> None:
    """DNS rebinding: a page of another site that resolves its name to 127.0.0.1."""
    import http.client  # noqa: PLC0415

    host, port = console.split("://", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/inbox", headers={"Host": "evil.example"})
        assert conn.getresponse().status == 400
    finally:
        conn.close()
    assert call(console, "/inbox").status == 200


def test_a_scripts_json_takes_evidence_as_an_object_and_refuses_odd_types(
        console: str, engine: Engine) -> None:
    _, op_id = unknown_order(engine, "json-types")
    for body in ({"outcome": "not-applied", "reason": 42},
                 {"outcome": ["confirmed"]},
                 {"outcome": "confirmed", "evidence": [1, 2]}):
        answer = call(console, f"/operations/{op_id}/resolve", body=body)
        assert answer.status == 400, (body, answer.body)
    done = call(console, f"/operations/{op_id}/resolve",
                body={"outcome": "confirmed", "evidence": {"reference": "PO-9"}})
    assert done.status == 200, done.body
    assert _op_status(engine, op_id) == "confirmed"


def test_the_live_overview_is_a_stream_of_server_sent_events(console: str, engine: Engine
                                                            ) -> None:
    import base64  # noqa: PLC0415
    import json  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    from tests.integration.console_support import PASSWORDS  # noqa: PLC0415

    token = base64.b64encode(f"vic:{PASSWORDS['vic']}".encode()).decode()
    request = urllib.request.Request(console + "/events",  # noqa: S310 - loopback
                                     headers={"Authorization": f"Basic {token}"})
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(request, timeout=20) as stream:  # noqa: S310
        assert stream.headers["content-type"].startswith("text/event-stream")
        for raw in stream:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    unknown_order(engine, "live")  # the next event must count it
                elif events[-1]["runs"]["waiting"] == 1:
                    break
            assert len(events) < 20, "the stream never showed the new run"
    assert events[0]["runs"]["waiting"] == 0
    assert events[-1]["operations"]["needs-human"] == 1


def test_an_operator_replays_a_dead_letter_once(database_url: str, engine: Engine,
                                               kafka_bootstrap: str, kafka_topic: Any) -> None:
    from kafka import KafkaConsumer  # noqa: PLC0415

    from tests.integration.test_cli_dlq import dead_letter  # noqa: PLC0415

    topic = kafka_topic()
    with engine.begin() as conn:
        failure_id, _ = dead_letter(conn, topic, 4, "widget")
    with serving(database_url, kafka_bootstrap=kafka_bootstrap) as base:
        page = call(base, "/messages")
        assert f'id="failure-{failure_id}"' in page.body
        answer = call(base, f"/failures/{failure_id}/replay",
                      form={"csrf": csrf_of(page.body), "next": "/messages"})
        assert answer.status == 303
        assert "republished" in answer.headers["location"]
        assert "by%20olga" in answer.headers["location"]
        again = call(base, f"/failures/{failure_id}/replay", body={})
        assert again.status == 409
        assert "not dead-lettered" in again.json()["error"]
        assert call(base, "/failures/abc/replay", body={}).status == 400
    consumer = KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap,
                             auto_offset_reset="earliest", consumer_timeout_ms=3_000)
    try:
        assert sum(1 for _ in consumer) == 1
    finally:
        consumer.close()


def test_the_overview_shows_each_groups_lag_per_partition(
        database_url: str, kafka_bootstrap: str, kafka_topic: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kafka import (  # noqa: PLC0415
        KafkaConsumer,
        KafkaProducer,
        OffsetAndMetadata,
        TopicPartition,
    )

    monkeypatch.delenv("OUTBOXKIT_KAFKA_BOOTSTRAP", raising=False)
    topic = kafka_topic()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for _ in range(7):
        producer.send(topic, value=b"x", partition=0).get(timeout=20)
    producer.close()
    name = f"console-lag-{uuid.uuid4().hex[:6]}"
    member = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=name,
                           enable_auto_commit=False)
    member.commit({TopicPartition(topic, 0): OffsetAndMetadata(3, "", -1)})
    member.close()
    with serving(database_url, kafka_bootstrap=kafka_bootstrap) as base:
        first = call(base, "/", as_json=True).json()  # never waits for Kafka: read meanwhile
        assert first["consumers"] is None
        assert "reading" in first["consumers_error"]
        deadline = time.monotonic() + 30
        while (data := call(base, "/", as_json=True).json())["consumers"] is None:
            assert time.monotonic() < deadline, data["consumers_error"]
            time.sleep(0.2)
        page = call(base, "/")
    lags = [g["lag"] for g in data["consumers"]]
    assert lags == sorted(lags, reverse=True)  # the groups most behind first
    [found] = [g for g in data["consumers"] if g["group"] == name]
    assert found["partitions"] == [{"topic": topic, "partition": 0, "committed": 3, "end": 7,
                                    "lag": 4}]
    assert found["lag"] == 4
    assert 'id="lag"' in page.body  # the summary (the 15 groups most behind; many share the broker)
    with serving(database_url) as base:  # no Kafka configured: said, not an error
        data = call(base, "/", as_json=True).json()
    assert data["consumers"] is None
    assert "OUTBOXKIT_KAFKA_BOOTSTRAP" in data["consumers_error"]


def test_dead_letters_are_grouped_by_reason_and_an_operator_discards_one(
        console: str, engine: Engine) -> None:
    from tests.integration.test_cli_dlq import dead_letter  # noqa: PLC0415

    with engine.begin() as conn:
        ids = [dead_letter(conn, "order.submit", n, "widget")[0] for n in range(3)]
    page = call(console, "/messages")
    assert 'id="failure-groups"' in page.body
    groups = call(console, "/messages", as_json=True).json()["groups"]
    assert [(g["consumer_group"], g["reason"], g["messages"]) for g in groups] == [
        ("orders", "supplier API down", 3)]
    assert call(console, f"/failures/{ids[0]}/discard", body={}).status == 400  # no reason
    done = call(console, f"/failures/{ids[0]}/discard", body={"reason": "cancelled"})
    assert done.status == 200, done.body
    assert call(console, f"/failures/{ids[0]}/discard",
                body={"reason": "again"}).status == 409
    shown = call(console, "/messages?failures=discarded").body
    assert "discarded by olga: cancelled" in shown


def test_the_backlog_is_shown_by_lane_and_topic(console: str, engine: Engine) -> None:
    from outbox.db.queries import driver_sql  # noqa: PLC0415
    from outbox.messages.emit import emit_many  # noqa: PLC0415
    from outbox.messages.envelope import Envelope  # noqa: PLC0415
    from outbox.settings import OutboxSettings  # noqa: PLC0415

    with engine.begin() as conn:  # the lanes a relay makes when it starts, with no relay
        conn.exec_driver_sql(driver_sql("relay", "ensure_lanes", "outboxkit"),
                             {"lanes": OutboxSettings().lanes})
        emit_many(conn, [Envelope(topic="orders", type="t", key="same-key", payload={"n": n})
                         for n in range(5)])  # published below: not in the backlog
    with engine.begin() as conn:  # as if a relay published them: the cursors are past them
        conn.execute(text("UPDATE outboxkit.relay_lanes SET cursor_snapshot = "
                          "pg_current_snapshot()"))
    with engine.begin() as conn:
        emit_many(conn, [Envelope(topic=topic, type="t", key="same-key", payload={"n": n})
                         for topic, n in (("orders", 1), ("orders", 2), ("refunds", 3))])
    data = call(console, "/", as_json=True).json()
    assert data["backlog"] == 3
    rows = [(b["topic"], b["messages"]) for b in data["backlog_by_topic"]]
    assert sorted(rows) == [("orders", 2), ("refunds", 1)]
    assert len({b["lane"] for b in data["backlog_by_topic"]}) == 1  # one key, one lane
    assert 'id="backlog"' in call(console, "/").body


def test_a_backlog_past_the_capped_read_is_estimated_and_says_so(
        console: str, engine: Engine) -> None:
    from outbox.db.queries import driver_sql  # noqa: PLC0415
    from outbox.messages.emit import emit_many  # noqa: PLC0415
    from outbox.messages.envelope import Envelope  # noqa: PLC0415
    from outbox.settings import OutboxSettings  # noqa: PLC0415

    with engine.begin() as conn:
        conn.exec_driver_sql(driver_sql("relay", "ensure_lanes", "outboxkit"),
                             {"lanes": OutboxSettings().lanes})
        conn.execute(text("UPDATE outboxkit.relay_lanes SET cursor_snapshot = "
                          "pg_current_snapshot()"))
    with engine.begin() as conn:  # one lane (one key), 1,000 rows: past the 256 read a lane
        emit_many(conn, [Envelope(topic="refunds" if n % 5 in (1, 3) else "orders", type="t",
                                  key="same-key", payload={"n": n}) for n in range(1000)])
    data = call(console, "/", as_json=True).json()
    assert data["backlog_estimated"] is True
    assert abs(data["backlog"] - 1000) <= 30, data["backlog"]
    read = [b for b in data["backlog_by_topic"] if not b["estimated"]]
    [more] = [b for b in data["backlog_by_topic"] if b["estimated"]]
    assert sum(b["messages"] for b in read) == 256  # what the capped read saw, by topic
    assert all(b["topic"] for b in read)
    assert more["topic"] is None  # the rest's topics are not known
    assert abs(more["messages"] - 744) <= 30, more
    from console.reads import overview  # noqa: PLC0415

    with engine.begin() as conn:  # what a refresh fetched: the capped read, not the backlog
        overview(conn, OutboxSettings(), lease_seconds=30)
        fetched = conn.execute(text(
            "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
            " WHERE schemaname = 'outboxkit' AND relname = 'outbox_messages'")).scalar_one()
    assert fetched <= 300, fetched
    assert "≈" in call(console, "/").body


def test_rows_waiting_behind_a_refused_one_and_a_runs_confirmations_are_shown(
        console: str, engine: Engine) -> None:
    from outbox.messages.emit import emit  # noqa: PLC0415
    from outbox.messages.envelope import Envelope  # noqa: PLC0415
    from outbox.runs.confirm import apply_confirmation  # noqa: PLC0415
    from tests.integration.cli_support import refuse  # noqa: PLC0415

    with engine.begin() as conn:
        for n in range(2):
            emit(conn, Envelope(topic="orders", type="t", key="acme", payload={"n": n}))
        first, second = conn.execute(text(
            "SELECT id FROM outboxkit.outbox_messages ORDER BY id")).scalars().all()
        refuse(conn, first, error="too large", blocking=True)
        refuse(conn, second, error="behind")  # as the relay sets it aside: held
        conn.execute(text("UPDATE outboxkit.outbox_failures SET state = 'held', error = NULL "
                          "WHERE id = :i"), {"i": second})
    waiting = call(console, "/messages", as_json=True).json()["waiting"]
    assert [(w["id"], w["key"], w["state"]) for w in waiting] == [(second, "acme", "held")]
    assert "held back" in call(console, "/messages").body

    run_id = waiting_run(engine, "confirmed-run")
    with engine.begin() as conn:
        apply_confirmation(conn, run_id=run_id, confirmation_id="supplier-ack-1",
                           outcome="running", evidence={"ok": True}, actor="orders-consumer")
    page = call(console, f"/runs/{run_id}")
    assert 'id="confirmations"' in page.body
    assert "supplier-ack-1" in page.body
    assert "orders-consumer" in page.body
