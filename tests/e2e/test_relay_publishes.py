"""The relay against the real PostgreSQL and the real Kafka broker."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
import uuid

import pytest
from sqlalchemy import Engine, text

from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from tests.e2e.conftest import RelayProcesses, count_status, read_topic, wait_until


@pytest.mark.usefixtures("kafka_client")
def test_every_committed_message_arrives_exactly_as_written_and_a_rolled_back_one_never(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    committed = [
        Envelope(
            topic=topic,
            type="order.submit",
            key=f"order-{i % 5}",
            payload={"i": i, "text": "grüße ✓"},
            correlation_id=f"corr-{i}",
            headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        )
        for i in range(40)
    ]
    rolled_back = Envelope(topic=topic, type="order.submit", key="order-x", payload={"no": 1})
    with engine.connect() as conn:
        trans = conn.begin()
        emit(conn, rolled_back)
        trans.rollback()
    with engine.begin() as conn:
        for envelope in committed:
            emit(conn, envelope)

    relays.start()
    wait_until(lambda: count_status(engine, "published") == 40, 60, "40 published rows")
    records = read_topic(kafka_bootstrap, topic)

    by_id = {dict(r.headers)["message-id"].decode(): r for r in records}
    assert str(rolled_back.message_id) not in by_id
    assert len(records) == 40
    for envelope in committed:
        record = by_id[str(envelope.message_id)]
        headers = dict(record.headers)
        assert record.key == envelope.key.encode()  # type: ignore[union-attr]
        assert json.loads(record.value) == envelope.payload
        assert headers["message-type"] == b"order.submit"
        assert headers["traceparent"].startswith(b"00-0af765")
        assert headers["correlation-id"] == envelope.correlation_id.encode()  # type: ignore[union-attr]
    with engine.connect() as conn:
        proof = conn.execute(
            text("SELECT message_id, kafka_partition, kafka_offset FROM outboxkit.message_status")
        ).all()
    for message_id, partition, offset in proof:
        record = by_id[str(message_id)]
        assert (record.partition, record.offset) == (partition, offset)


@pytest.mark.usefixtures("kafka_client")
def test_sigterm_drains_and_exits_zero_and_metrics_serve_the_figures(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = f"drain-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    # Python lists every module the process imports, at start-up or later, in its log.
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    proc = relays.start("drainer", http_port=port)
    wait_until(lambda: _get(port, "/readyz")[0] == 200, 60, "the relay to be ready")
    with engine.begin() as conn:
        for i in range(2000):
            emit(conn, Envelope(topic=topic, type="t", key=f"k{i % 50}", payload={"i": i}))
    wait_until(lambda: count_status(engine, "published") > 0, 30, "publishing to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    # From start to stop, its jobs included, the relay ran without SQLAlchemy (outbox.db.pool):
    # a third of its start-up time was importing it.
    imported = re.findall(r"^import time:.*\|\s+([\w.]+)$",
                          (relays.log_dir / "drainer.log").read_text(), re.MULTILINE)
    assert "relay.daemon" in imported  # the listing is there
    assert not [m for m in imported if m.split(".")[0] == "sqlalchemy"]
    # Whatever was sent before the stop was marked; the rest is still pending, not lost.
    published = count_status(engine, "published")
    assert published + count_status(engine, "pending") == 2000
    assert (
        len({dict(r.headers)["message-id"] for r in read_topic(kafka_bootstrap, topic)})
        >= published
    )
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outboxkit.relays")).scalar_one() == 0
        assert (
            conn.execute(
                text("SELECT count(*) FROM outboxkit.relay_lanes WHERE owner IS NOT NULL")
            ).scalar_one()
            == 0
        )


def test_metrics_endpoint_serves_backlog_age_totals_latency_and_lanes(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    topic = f"metrics-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    relays.start(http_port=port)
    wait_until(lambda: _get(port, "/readyz")[0] == 200, 60, "the relay to be ready")
    with engine.begin() as conn:
        for i in range(25):
            emit(conn, Envelope(topic=topic, type="t", key="k", payload={"i": i}))
    wait_until(lambda: count_status(engine, "published") == 25, 30, "25 published")
    wait_until(
        lambda: "outboxkit_relay_published_total 25.0" in _get(port, "/metrics")[1],
        15,
        "the published counter",
    )
    status, body = _get(port, "/metrics")
    assert status == 200
    for name in (
        "outboxkit_relay_backlog_messages",
        "outboxkit_relay_oldest_pending_age_seconds",
        "outboxkit_relay_failed_total",
        "outboxkit_relay_publish_latency_seconds_bucket",
        "outboxkit_relay_lanes_owned 64.0",
    ):
        assert name in body
    assert _get(port, "/healthz")[0] == 200


def _free_port() -> int:
    from outbox.testing.processes import free_port  # noqa: PLC0415

    return free_port()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""
    finally:
        time.sleep(0)
