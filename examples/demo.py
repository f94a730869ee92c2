"""The outboxkit demo: agent state and an effect message committed together, relayed to
Kafka, handled by a consumer, and confirmed back to the run — against a real PostgreSQL
and a real Kafka broker.

    make demo                      # starts the services itself
    python examples/demo.py        # same, once `make bootstrap` has run

Five supplier-order runs each decide to order, commit "waiting + order.submit" in ONE
transaction, and wait. The relay (a separate process) publishes the messages; a consumer
places each order at the supplier table and confirms the run with the supplier's reference
as evidence, in ONE transaction with its dedup mark. The demo ends with a summary and exits
non-zero if an invariant does not hold (every run done with evidence, one order per run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kafka import KafkaConsumer
from sqlalchemy import Engine, create_engine, text

from outbox import Envelope, apply_confirmation, claim, emit, migrate, start_run, transition
from outbox.dsn import redact, sqlalchemy_url
from outbox.testing.services import LocalServices

ROOT = Path(__file__).resolve().parents[1]
RUNS = 5
TOPIC = f"order.submit.demo-{uuid.uuid4().hex[:6]}"

# The example's own tables: the supplier's record of orders, and the consumer's dedup marks.
EXAMPLE_SCHEMA = """
CREATE TABLE IF NOT EXISTS demo_supplier_orders (
    order_ref text PRIMARY KEY, run_id uuid NOT NULL UNIQUE, item text NOT NULL,
    placed_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS demo_handled (
    consumer text NOT NULL, message_id uuid NOT NULL, PRIMARY KEY (consumer, message_id));
"""


def say(text_: str) -> None:
    print(f"[demo] {text_}", flush=True)


def decide_and_order(engine: Engine, index: int) -> uuid.UUID:
    """One agent step: the run moves to waiting and asks for the order, atomically."""
    with engine.begin() as conn:
        run = start_run(conn, workflow="supplier-order", workflow_version="1",
                        idempotency_key=f"demo-order-{TOPIC}-{index}",
                        checkpoint={"item": f"widget-{index}", "qty": index + 1})
    with engine.begin() as conn:
        claimed = claim(conn, worker="demo-agent", lease_seconds=30)
        assert claimed is not None
        assert claimed.run.id == run.id
        lease = transition(conn, claimed.lease, "waiting", step="order-submitted",
                           reason="model proposed the order; runtime recorded the intent",
                           evidence={"plan": f"order widget-{index}"}, actor="demo-agent")
        emit(conn, Envelope(topic=TOPIC, type="order.submit", key="supplier-acme",
                            payload={"run_id": str(run.id), "item": f"widget-{index}",
                                     "qty": index + 1}, run_id=run.id), lease=lease)
    return run.id


def handle(engine: Engine, record: object) -> bool:
    """The consumer: place the order and confirm the run, with the dedup mark, atomically."""
    headers = dict(record.headers)  # type: ignore[attr-defined]
    message_id = uuid.UUID(headers["message-id"].decode())
    order = json.loads(record.value)  # type: ignore[attr-defined]
    with engine.begin() as conn:
        fresh = conn.execute(text(
            "INSERT INTO demo_handled VALUES ('demo-consumer', :m) ON CONFLICT DO NOTHING"),
            {"m": message_id}).rowcount
        if not fresh:
            return False  # a redelivery: the effect already happened
        ref = f"ACME-{uuid.uuid4().hex[:8].upper()}"
        conn.execute(text("INSERT INTO demo_supplier_orders (order_ref, run_id, item) "
                          "VALUES (:r, :run, :item)"),
                     {"r": ref, "run": order["run_id"], "item": order["item"]})
        apply_confirmation(conn, run_id=uuid.UUID(order["run_id"]), confirmation_id=message_id,
                           outcome="done", evidence={"supplier_ref": ref}, actor="demo-consumer")
    return True


def endpoints_to_use() -> tuple[str, str]:
    """The services named by OUTBOXKIT_DATABASE_URL / OUTBOXKIT_KAFKA_BOOTSTRAP, else local
    ones started (or reused) in .services/."""
    database_url = os.environ.get("OUTBOXKIT_DATABASE_URL")
    bootstrap = os.environ.get("OUTBOXKIT_KAFKA_BOOTSTRAP")
    if database_url and bootstrap:
        return database_url, bootstrap
    say("starting PostgreSQL and Kafka (local processes, no Docker needed)...")
    endpoints = LocalServices(ROOT / ".services").up()
    return endpoints.database_url, endpoints.kafka_bootstrap


def main() -> int:
    database_url, bootstrap = endpoints_to_use()
    url = sqlalchemy_url(database_url)
    engine = create_engine(url)
    migrate(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(EXAMPLE_SCHEMA)
    say(f"PostgreSQL {redact(database_url)}, Kafka {bootstrap}, schema migrated")

    run_ids = [decide_and_order(engine, i) for i in range(RUNS)]
    say(f"{RUNS} runs committed 'waiting' + an order.submit message in one transaction each")

    env = {**os.environ, "OUTBOXKIT_RELAY_DATABASE_URL": url,
           "OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP": bootstrap,
           "OUTBOXKIT_RELAY_RELAY_ID": "demo-relay", "OUTBOXKIT_RELAY_LOG_LEVEL": "WARNING"}
    relay = subprocess.Popen([sys.executable, "-m", "relay"], env=env)
    say(f"relay started (pid {relay.pid})")
    consumer = KafkaConsumer(TOPIC, bootstrap_servers=bootstrap,
                             group_id="demo-consumer", auto_offset_reset="earliest",
                             enable_auto_commit=False)
    handled = duplicates = 0
    deadline = time.monotonic() + 90
    try:
        while handled < RUNS and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                for record in records:
                    if handle(engine, record):
                        handled += 1
                    else:
                        duplicates += 1
                consumer.commit()  # only after the database commit: at-least-once
    finally:
        consumer.close()
        relay.send_signal(signal.SIGTERM)
        relay_exit = relay.wait(timeout=30)

    with engine.connect() as conn:
        states = dict(conn.execute(text(
            "SELECT state, count(*) FROM outboxkit.agent_runs WHERE id = ANY(:ids) GROUP BY 1"),
            {"ids": run_ids}).all())
        orders = conn.execute(text(
            "SELECT count(*), count(DISTINCT run_id) FROM demo_supplier_orders "
            "WHERE run_id = ANY(:ids)"), {"ids": run_ids}).one()
        published = conn.execute(text(
            "SELECT count(*) FROM outboxkit.outbox_messages WHERE topic = :t "
            "AND status = 'published'"), {"t": TOPIC}).scalar_one()
        evidence = conn.execute(text(
            "SELECT last_evidence FROM outboxkit.agent_runs WHERE id = ANY(:ids)"),
            {"ids": run_ids}).scalars().all()
    engine.dispose()

    say("summary")
    print(f"  runs by state          {states}")
    print(f"  messages published     {published} (relay exited {relay_exit})")
    print(f"  orders at supplier     {orders[0]} for {orders[1]} runs")
    print(f"  duplicates dropped     {duplicates}")
    print(f"  evidence on each run   {sorted(e['supplier_ref'] for e in evidence if e)}")
    ok = (states == {"done": RUNS} and orders[0] == orders[1] == RUNS and published == RUNS
          and all(e and e.get("supplier_ref") for e in evidence) and relay_exit == 0)
    say("all invariants hold" if ok else "INVARIANT FAILED")
    say("services keep running; stop them with `make services-down`")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
