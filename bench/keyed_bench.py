"""Per-message mode: keys of a partition handled at the same time, each key in order.

One run, one machine, one broker, durable PostgreSQL (as bench/consumer_bench.py, whose
helpers this uses). For each client of ``--clients``, side by side:

(p) a handler that does nothing, per-message mode (a transaction per message) at the
    default concurrency: ``consumer[.confluent].per_message_msgs_per_s``;
(i) a handler that waits 20 ms (an outside call), concurrency 64, 6 partitions, 1,000 keys:
    ``consumer[.confluent].io_bound_msgs_per_s``, against 0.8 x 64 / 0.020 = 2,560 msg/s or
    the CPU bound (the no-op rate of (p)), whichever is lower;
(k) kafka-python's default client only: key isolation: 1,000 keys on 3 partitions, one INSERT
    per message; on the second topic one key of partition 0 also holds 50 messages whose
    supplier hangs (the first attempt waits out a 0.2 s call, every attempt asks to
    ``RetryLater(..., 0.5)``). ``consumer.key_isolation_ratio``: the other keys' rate with
    that key failing against the same with it absent (``--rounds`` alternating rounds,
    median of the rounds' ratios);
(m) memory: peak RSS of a consumer process (per-message, no-op) that reads ``--keys-small``
    and then ``--keys-large`` distinct keys, one message each:
    ``consumer.keyed_rss_ratio`` (goal: within 1.2).

    .venv/bin/python bench/keyed_bench.py [--quick] [--clients kafka-python,confluent] \
        [--json results.json] [--database-url URL --kafka-bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import consumer_bench as cb  # bench/consumer_bench.py (this folder is on sys.path)
import psycopg
from durable import make_durable  # bench/durable.py
from figures import Figure, print_table  # bench/figures.py
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from sqlalchemy import create_engine, insert, text

from consumers import Consumer, ConsumerSettings, HandlerContext, RetryLater, Runner
from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate
from outbox.messages.ids import uuid7

IO_WAIT_S = 0.020
IO_CONCURRENCY = 64
GOAL_PER_MESSAGE_CONFLUENT = 5_000.0
GOAL_IO_FRACTION = 0.8
GOAL_KEY_ISOLATION = 0.95
GOAL_RSS_RATIO = 1.2
STUCK_KEY = b"stuck-key"
STUCK_MESSAGES = 50
CALL_TIMEOUT_S = 0.2
RECHECK_S = 0.5


def produce(bootstrap: str, topic: str, n: int, keys: int, *, partition: int | None = None,
            key: bytes | None = None) -> None:
    """*n* orders over *keys* keys (``key-<i % keys>``), or all under *key*."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=262_144)
    for i in range(n):
        producer.send(
            topic,
            key=key or f"key-{i % keys}".encode(),
            value=json.dumps({"n": i, "item": "widget", "qty": 3}).encode(),
            headers=[("message-id", str(uuid7()).encode()), ("message-type", b"order")],
            partition=partition,
        )
    producer.flush(timeout=300)
    producer.close()


def settings(url: str, bootstrap: str, **overrides: Any) -> ConsumerSettings:
    return ConsumerSettings(database_url=sqlalchemy_url(url), kafka_bootstrap=bootstrap,
                            mode="per-message", dedup_retention_seconds=0, **overrides)


def truncate(url: str) -> None:
    with create_engine(sqlalchemy_url(url)).begin() as conn:
        conn.execute(text("TRUNCATE public.bench_effects, outboxkit.consumer_inbox"))


def rate_of(url: str, bootstrap: str, topic: str, n: int, client: str, *,
            wait_s: float = 0.0, **overrides: Any) -> cb.Rate:
    """Per-message mode over *topic*'s *n* messages; the handler waits *wait_s*."""
    truncate(url)
    app = Consumer(f"keyed-{uuid.uuid4().hex[:8]}", settings=settings(url, bootstrap,
                                                                      **overrides))

    def handle(ctx: HandlerContext, order: cb.Order) -> None:
        if wait_s:
            time.sleep(wait_s)

    app.register(topic, handle)
    with cb.kafka_client(client):
        rate, done = cb.run_until(Runner(app), topic, n, limit_s=900)
    if done < n:
        raise SystemExit(f"per-message consumer ({client}) handled {done:.0f} of {n}")
    return rate


def isolation_rate(url: str, bootstrap: str, topic: str, n: int) -> cb.Rate:
    """(k): the keys other than STUCK_KEY (*n* messages), one INSERT each."""
    truncate(url)
    app = Consumer(f"keyed-iso-{uuid.uuid4().hex[:8]}", settings=settings(
        url, bootstrap, max_attempts=1000, backoff_max_seconds=RECHECK_S))
    called: set[str] = set()
    began = threading.Event()

    def handle(ctx: HandlerContext, order: cb.Order) -> None:
        began.set()
        if ctx.key == STUCK_KEY:
            if ctx.message_id not in called:
                called.add(ctx.message_id)
                time.sleep(CALL_TIMEOUT_S)  # the supplier never answers this call
            raise RetryLater("supplier hangs", RECHECK_S)
        ctx.conn.execute(insert(cb.effects), {"message_id": ctx.message_id, "n": order.n})

    app.register(topic, handle)
    with cb.kafka_client("kafka-python"):
        rate, done = cb.run_until(Runner(app), topic, n, limit_s=900, began=began)
    if done < n:
        raise SystemExit(f"(k) handled {done:.0f} of {n} other keys' messages")
    return rate


def peak_rss_mb(url: str, bootstrap: str, topic: str, n: int) -> float:
    """(m): a consumer process of its own reads *n* messages; its peak RSS."""
    proc = subprocess.run(
        [sys.executable, __file__, "--rss-child", url, bootstrap, topic, str(n)],
        capture_output=True, text=True, check=False, timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"(m) child failed: {proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def rss_child(url: str, bootstrap: str, topic: str, n: int) -> None:
    rate_of(url, bootstrap, topic, n, "confluent" if cb.missing_backend("confluent") is None
            else "kafka-python")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def client_figures(url: str, bootstrap: str, topic: str, n: int, client: str) -> list[Figure]:
    """(p) and (i) with *client*."""
    prefix = "consumer" if client == "kafka-python" else "consumer.confluent"
    cb.log(f"(p) {client}: per-message mode, no-op handler")
    noop = rate_of(url, bootstrap, topic, n, client)
    cb.log(f"(i) {client}: a handler that waits {IO_WAIT_S * 1000:.0f} ms, "
           f"concurrency {IO_CONCURRENCY}")
    io = rate_of(url, bootstrap, topic, n, client, wait_s=IO_WAIT_S, concurrency=IO_CONCURRENCY)
    target = min(GOAL_IO_FRACTION * IO_CONCURRENCY / IO_WAIT_S, noop.per_s)
    goal = (f">= {GOAL_PER_MESSAGE_CONFLUENT:,.0f} msg/s", noop.per_s
            >= GOAL_PER_MESSAGE_CONFLUENT) if client == "confluent" else (None, None)
    return [
        Figure(f"{prefix}.per_message_msgs_per_s", noop.per_s, "msg/s", None, None, *goal,
               note=f"{client}; a transaction per message, no-op handler, default "
               f"concurrency, {n:,} messages; {cb.spent([noop])}"),
        Figure(f"{prefix}.io_bound_msgs_per_s", io.per_s, "msg/s",
               IO_CONCURRENCY / IO_WAIT_S, io.per_s / (IO_CONCURRENCY / IO_WAIT_S),
               f">= {target:,.0f} msg/s", io.per_s >= target,
               note=f"{client}; handler waits {IO_WAIT_S * 1000:.0f} ms, concurrency "
               f"{IO_CONCURRENCY}, 6 partitions, 1,000 keys; ceiling 64/0.020; goal 0.8 x "
               f"that or (p)'s CPU bound; {cb.spent([io])}"),
    ]


def isolation_figure(url: str, bootstrap: str, topics: tuple[str, str], k: int,
                     rounds: int) -> Figure:
    """(k), in alternating rounds: *topics* = (no failing key, one key failing)."""
    idle, stuck = topics
    ratios, stuck_rates = [], []
    for round_ in range(1, rounds + 1):
        cb.log(f"round {round_}/{rounds}: (k) key isolation, no failing key")
        base = isolation_rate(url, bootstrap, idle, k)
        cb.log(f"round {round_}/{rounds}: (k) key isolation, one key failing")
        held = isolation_rate(url, bootstrap, stuck, k)
        ratios.append(held.per_s / base.per_s)
        stuck_rates.append(held)
    ratio = cb.median(ratios)
    return Figure(
        "consumer.key_isolation_ratio", ratio, "x", 1.0, ratio,
        f">= {GOAL_KEY_ISOLATION} x", ratio >= GOAL_KEY_ISOLATION,
        note=f"kafka-python; the other keys' rate ({k:,} messages, one INSERT each) while key "
             f"{STUCK_KEY.decode()} of partition 0 keeps failing, against none failing; "
             f"rounds {', '.join(f'{r:.3f}' for r in ratios)}; {cb.spent(stuck_rates)}")


def rss_figure(url: str, bootstrap: str, few: tuple[str, int], many: tuple[str, int]) -> Figure:
    """(m): a consumer process per size."""
    cb.log(f"(m) peak RSS with {few[1]:,} then {many[1]:,} distinct keys")
    rss_small = peak_rss_mb(url, bootstrap, *few)
    rss_large = peak_rss_mb(url, bootstrap, *many)
    ratio = rss_large / rss_small
    return Figure(
        "consumer.keyed_rss_ratio", ratio, "x", 1.0, ratio,
        f"<= {GOAL_RSS_RATIO} x", ratio <= GOAL_RSS_RATIO,
        note=f"peak RSS {rss_small:.0f} MB with {few[1]:,} distinct keys, {rss_large:.0f} MB "
             f"with {many[1]:,} (a consumer process each, per-message, no-op)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--n", type=int, help="messages for (p) and (i) (default 20,000; quick 1,000)")
    p.add_argument("--n-isolation", type=int, help="other keys' messages for (k) "
                   "(default 10,000; quick 500)")
    p.add_argument("--keys-small", type=int, help="(m) small (default 10,000; quick 1,000)")
    p.add_argument("--keys-large", type=int, help="(m) large (default 100,000; quick 3,000)")
    p.add_argument("--rounds", type=int, help="rounds of (k) (default 3; quick 1)")
    p.add_argument("--clients", default=",".join(cb.CLIENTS))
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--state-dir", help="where the throwaway services live (kept if given)")
    p.add_argument("--database-url", help="an existing PostgreSQL server (admin URL)")
    p.add_argument("--kafka-bootstrap", help="an existing Kafka broker host:port")
    p.add_argument("--allow-not-durable", action="store_true",
                   help="leave the server's durability as it is (figures then mean nothing)")
    p.add_argument("--rss-child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    return args


def measure(admin_url: str, bootstrap: str, args: argparse.Namespace,
            clients: list[str]) -> list[Figure]:
    quick = args.quick
    n = args.n or (1_000 if quick else 20_000)
    k = args.n_isolation or (500 if quick else 10_000)
    small = args.keys_small or (1_000 if quick else 10_000)
    large = args.keys_large or (3_000 if quick else 100_000)
    rounds = args.rounds or (1 if quick else 3)
    name = f"keyedbench_{uuid.uuid4().hex[:8]}"
    suffix = uuid.uuid4().hex[:6]
    topic, idle, stuck = f"keyed-{suffix}", f"keyed-idle-{suffix}", f"keyed-stuck-{suffix}"
    few, many = f"keyed-few-{suffix}", f"keyed-many-{suffix}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin_url, name)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    figures: list[Figure] = []
    try:
        engine = create_engine(sqlalchemy_url(url))
        migrate(engine)
        with engine.begin() as db:
            cb.effects.create(db)
        engine.dispose()
        admin.create_topics([NewTopic(t, p, 1) for t, p in (
            (topic, 6), (idle, 3), (stuck, 3), (few, 6), (many, 6))])
        cb.log(f"producing {n:,} messages over 1,000 keys, {k:,} twice for (k), "
               f"{small:,} and {large:,} distinct keys for (m)")
        produce(bootstrap, topic, n, 1_000)
        for t in (idle, stuck):
            produce(bootstrap, t, k, 1_000)
        produce(bootstrap, stuck, STUCK_MESSAGES, 1, partition=0, key=STUCK_KEY)
        produce(bootstrap, few, small, small)
        produce(bootstrap, many, large, large)
        for client in clients:
            figures += client_figures(url, bootstrap, topic, n, client)
        if "kafka-python" in clients:
            figures.append(isolation_figure(url, bootstrap, (idle, stuck), k, rounds))
        figures.append(rss_figure(url, bootstrap, (few, small), (many, large)))
    finally:
        with contextlib.suppress(Exception):
            admin.delete_topics([topic, idle, stuck, few, many])
        admin.close()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.rss_child:
        url, bootstrap, topic, n = args.rss_child
        rss_child(url, bootstrap, topic, int(n))
        return 0
    clients = [c for c in args.clients if cb.missing_backend(c) is None]
    if not clients:
        raise SystemExit("no Kafka client left to measure")
    with cb.services(args) as (admin_url, bootstrap):
        durability, restore = (("not checked (--allow-not-durable)", lambda: None)
                               if args.allow_not_durable else make_durable(admin_url))
        cb.log(f"durability: {durability}")
        try:
            figures = measure(admin_url, bootstrap, args, clients)
        finally:
            restore()
    print(f"\nper-message mode; clients {', '.join(clients)}; {os.cpu_count()} cpus; "
          f"PostgreSQL {durability}\n")
    print_table(figures)
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": [f.as_json() for f in figures]},
                                              indent=2))
    return 0 if all(math.isfinite(f.value) for f in figures) else 1


if __name__ == "__main__":
    raise SystemExit(main())
