"""What the idempotent consumer delivers, against what kafka-python's consumer alone can do.

One run, one machine, one broker, durable PostgreSQL (a throwaway cluster started here with
``outbox.testing.services.LocalServices``, then fsync, synchronous_commit and
full_page_writes turned on with ALTER SYSTEM and checked with SHOW; stopped at the end):

(a) ceiling: a raw ``KafkaConsumer`` (no auto commit) polls the N messages of a 3-partition
    topic and does nothing with them;
(b) batch mode: ``consumers.Runner`` with a per-message handler that inserts one row (one
    transaction per poll batch, the marks in one statement, a savepoint per message);
(c) batch mode with a batch handler that inserts the batch's rows in one statement;
(d) per-message mode (a transaction per message) on the first ``--n-per-message`` messages.

Each is a fresh consumer group reading the same topic; rates are measured from the first
processed message to the last (start-up and group join excluded).

Or give ``--database-url`` and ``--kafka-bootstrap`` to use existing services: the benchmark
then works in a database and a topic of its own, dropped at the end, and restores the
server's durability settings.

    OUTBOXKIT_KAFKA_LIBS=/tmp/kjars/libs .venv/bin/python bench/consumer_bench.py \
        [--quick] [--n N] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import throwaway  # bench/throwaway.py (this folder is on sys.path)
from durable import make_durable  # bench/durable.py (this folder is on sys.path)
from figures import Figure, print_table  # bench/figures.py (this folder is on sys.path)
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, Table, Text, create_engine, insert, text

from consumers import Consumer, ConsumerSettings, HandlerContext, Runner
from outbox.dsn import sqlalchemy_url, with_database
from outbox.migrate import migrate

GOAL_RATIO = 0.5

effects = Table(
    "bench_effects",
    MetaData(schema="public"),
    Column("message_id", Text, primary_key=True),
    Column("n", Integer, nullable=False),
)


class Order(BaseModel):
    n: int
    item: str
    qty: int


def log(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


# --- services and durability ---------------------------------------------------------------


def services(args: argparse.Namespace) -> contextlib.AbstractContextManager[tuple[str, str]]:
    return throwaway.services(args, "consumerbench", log)


# --- the workload ----------------------------------------------------------------------------


def produce(bootstrap: str, topic: str, n: int) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=262_144)
    for i in range(n):
        payload = json.dumps({"n": i, "item": "widget", "qty": 3}).encode()
        producer.send(
            topic,
            key=f"customer-{i % 200}".encode(),
            value=payload,
            headers=[("message-id", str(uuid.uuid4()).encode()), ("message-type", b"order")],
        )
    producer.flush(timeout=120)
    producer.close()


def raw_rate(bootstrap: str, topic: str, n: int, max_poll_records: int) -> float:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"raw-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=max_poll_records,
    )
    seen, first = 0, 0.0
    deadline = time.monotonic() + 600
    try:
        while seen < n and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                if not first:
                    first = time.perf_counter()
                seen += len(batch)
        took = time.perf_counter() - first
    finally:
        consumer.close(autocommit=False)
    return (seen - 1) / took if took > 0 else math.nan


def consumer_rate(
    url: str,
    bootstrap: str,
    topic: str,
    n: int,
    *,
    mode: str,
    batch_handler: bool,
    max_poll_records: int,
) -> float:
    with create_engine(sqlalchemy_url(url)).begin() as conn:
        conn.execute(text("TRUNCATE public.bench_effects, outboxkit.consumer_inbox"))
    settings = ConsumerSettings(
        database_url=sqlalchemy_url(url),  # type: ignore[arg-type]
        kafka_bootstrap=bootstrap,
        mode=mode,  # type: ignore[arg-type]
        max_poll_records=max_poll_records,
        dedup_retention_seconds=0,
    )
    app = Consumer(f"bench-{uuid.uuid4().hex[:8]}", settings=settings)
    if batch_handler:

        def write_batch(batch: Sequence[tuple[HandlerContext, Order]]) -> None:
            # What a throughput-minded batch handler does: one statement for the batch.
            batch[0][0].conn.exec_driver_sql(
                "INSERT INTO public.bench_effects (message_id, n) "
                "SELECT * FROM unnest(%(ids)s::text[], %(ns)s::integer[])",
                {"ids": [c.message_id for c, _ in batch], "ns": [o.n for _, o in batch]},
            )

        app.register_batch(topic, Order, write_batch)
    else:

        def write_one(ctx: HandlerContext, order: Order) -> None:
            ctx.conn.execute(insert(effects), {"message_id": ctx.message_id, "n": order.n})

        app.register(topic, Order, write_one)
    runner = Runner(app)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    counter = runner.metrics.processed.labels(topic)
    first_at, first_count = 0.0, 0.0
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            done = counter._value.get()
            if done and not first_at:
                first_at, first_count = time.perf_counter(), done
            if done >= n:
                took = time.perf_counter() - first_at
                return (done - first_count) / took if took > 0 else math.nan
            time.sleep(0.005)
        raise SystemExit(f"{mode} consumer did not process {n} messages in 900 s")
    finally:
        runner.stop()
        thread.join(timeout=60)


# --- report --------------------------------------------------------------------------------


def machine_info(dsn: str, bootstrap: str) -> dict[str, Any]:
    import kafka  # noqa: PLC0415

    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with psycopg.connect(dsn) as conn:
        server = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgres": server,
        "kafka_python": kafka.__version__,
        "kafka_bootstrap": bootstrap,
        "loadavg_start": os.getloadavg(),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small N: a smoke run")
    p.add_argument("--n", type=int, help="messages for (a)-(c) (default 50,000; quick 10,000)")
    p.add_argument(
        "--n-per-message", type=int, help="messages for (d) (default 3,000; quick 1,000)"
    )
    p.add_argument("--max-poll-records", type=int, default=500, help="batch size of all runs")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--state-dir", help="where the throwaway services live (kept if given)")
    p.add_argument("--database-url", help="an existing PostgreSQL server (admin URL)")
    p.add_argument("--kafka-bootstrap", help="an existing Kafka broker host:port")
    p.add_argument(
        "--allow-not-durable",
        action="store_true",
        help="leave the server's durability as it is (a smoke run on a test server; figures "
        "then mean nothing)",
    )
    return p.parse_args(argv)


def measure(
    admin_url: str, bootstrap: str, n: int, n_pm: int, mpr: int
) -> tuple[float, float, float, float]:
    """(a) to (d), in a database and a topic of their own, dropped at the end."""
    name = f"consumerbench_{uuid.uuid4().hex[:8]}"
    topic = f"bench-orders-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin_url, name)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        engine = create_engine(sqlalchemy_url(url))
        migrate(engine)
        with engine.begin() as conn:
            effects.create(conn)
        engine.dispose()
        admin.create_topics([NewTopic(topic, 3, 1)])
        log(f"producing {n:,} messages to {topic}")
        produce(bootstrap, topic, n)
        log("(a) raw kafka-python consumer")
        raw = raw_rate(bootstrap, topic, n, mpr)
        log("(b) batch mode, per-message handler")
        batch = consumer_rate(
            url, bootstrap, topic, n, mode="batch", batch_handler=False, max_poll_records=mpr
        )
        log("(c) batch mode, batch handler")
        batch_handler = consumer_rate(
            url, bootstrap, topic, n, mode="batch", batch_handler=True, max_poll_records=mpr
        )
        log(f"(d) per-message mode on {n_pm:,} messages")
        per_message = consumer_rate(
            url,
            bootstrap,
            topic,
            n_pm,
            mode="per-message",
            batch_handler=False,
            max_poll_records=mpr,
        )
    finally:
        with contextlib.suppress(Exception):
            admin.delete_topics([topic])
        admin.close()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return raw, batch, batch_handler, per_message


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    n = args.n or (10_000 if args.quick else 50_000)
    n_pm = min(n, args.n_per_message or (1_000 if args.quick else 3_000))
    started = datetime.now(UTC)
    mpr = args.max_poll_records
    with services(args) as (admin_url, bootstrap):
        durability, restore = (
            ("not checked (--allow-not-durable)", lambda: None)
            if args.allow_not_durable
            else make_durable(admin_url)
        )
        log(f"durability: {durability}")
        machine = machine_info(admin_url, bootstrap)
        try:
            raw, batch, batch_handler, per_message = measure(admin_url, bootstrap, n, n_pm, mpr)
        finally:
            restore()
    machine["loadavg_end"] = os.getloadavg()
    goal = f">= {GOAL_RATIO} x raw"
    figures = [
        Figure("consumer.raw_msgs_per_s", raw, "msg/s", note="kafka-python poll only"),
        Figure(
            "consumer.batch_msgs_per_s",
            batch,
            "msg/s",
            raw,
            batch / raw,
            note="per-message handler, one INSERT each, savepoint per message",
        ),
        Figure(
            "consumer.batch_ratio",
            batch / raw,
            "x",
            1.0,
            batch / raw,
            goal,
            batch / raw >= GOAL_RATIO,
        ),
        Figure(
            "consumer.batch_handler_msgs_per_s",
            batch_handler,
            "msg/s",
            raw,
            batch_handler / raw,
            goal,
            batch_handler / raw >= GOAL_RATIO,
            note="batch handler, one INSERT ... unnest per poll batch",
        ),
        Figure(
            "consumer.per_message_msgs_per_s",
            per_message,
            "msg/s",
            raw,
            per_message / raw,
            note=f"one transaction per message, {n_pm} messages",
        ),
    ]
    print(
        f"\nmachine: {machine['cpus']} cpus ({machine['cpu_model']}), load avg at start "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_end'])}; PostgreSQL "
        f"{machine['postgres']} ({durability}), kafka-python {machine['kafka_python']}; "
        f"N={n:,} (per-message {n_pm:,}), max_poll_records={mpr}\n"
    )
    print_table(figures)
    if args.json:
        document = {
            "machine": machine,
            "started": started.isoformat(),
            "figures": [f.as_json() for f in figures],
        }
        Path(args.json).write_text(json.dumps(document, indent=2))
        print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
