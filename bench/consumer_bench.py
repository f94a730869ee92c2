"""What the idempotent consumer delivers, against what kafka-python's consumer alone can do.

One run, one machine, one broker, durable PostgreSQL (a throwaway cluster started here with
``outbox.testing.services.LocalServices``, then fsync, synchronous_commit and
full_page_writes turned on with ALTER SYSTEM and checked with SHOW; stopped at the end):

(a) ceiling: a raw ``KafkaConsumer`` (no auto commit) polls the N messages of a 3-partition
    topic and does nothing with them;
(b) batch mode: ``consumers.Runner`` with a per-message handler that inserts one row (one
    transaction per poll batch, the marks in one statement, a savepoint per message);
(c) batch mode with a batch handler that inserts the batch's rows in one statement;
(d) per-message mode (a transaction per message) on the first ``--n-per-message`` messages;
(e) retry isolation: two 4-partition topics with the same ``--n-isolation`` messages on
    partitions 1 to 3 (b's handler); on the second, partition 0 also holds 50 messages whose
    supplier hangs (the first attempt waits out a 0.2 s call timeout, every attempt asks to
    ``RetryLater(..., 0.5)``, as ``dedup.perform`` answers while an unknown operation's next
    status check is not due). ``consumer.retry_isolation_ratio``: partitions 1 to 3's rate
    with partition 0 stuck against their rate with partition 0 idle, both counted from the
    handler's first call (so the one call timeout is always inside).

Each is a fresh consumer group reading the same topic; rates are measured from the first
processed message to the last (start-up and group join excluded). (a) to (c) and (e) run in
``--rounds`` alternating rounds (default 3) and their medians are reported, the ratios as
the median of each round's ratio (the ceiling and the consumer measured side by side). Each
phase also records how many cores this process used and how busy the whole machine was: on a
shared machine that tells a slow consumer from a starved one.

Or give ``--database-url`` and ``--kafka-bootstrap`` to use existing services: the benchmark
then works in a database and a topic of its own, dropped at the end, and restores the
server's durability settings.

    OUTBOXKIT_KAFKA_LIBS=/tmp/kjars/libs .venv/bin/python bench/consumer_bench.py \
        [--quick] [--n N] [--n-isolation K] [--rounds R] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import socket
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import throwaway  # bench/throwaway.py (this folder is on sys.path)
from durable import make_durable  # bench/durable.py (this folder is on sys.path)
from figures import Figure, Spent, cpu_budget, print_table  # bench/figures.py (on sys.path)
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, Table, Text, create_engine, insert, text

from consumers import Consumer, ConsumerSettings, HandlerContext, RetryLater, Runner
from outbox.dsn import sqlalchemy_url, with_database
from outbox.migrate import migrate

GOAL_RATIO = 0.5
GOAL_ISOLATION = 0.9  # issue 13: the other partitions within 10 % of normal

# (e): partition 0's supplier hangs; partitions 1 to 3 carry the measured work.
STUCK_PARTITION = 0
STUCK_MESSAGES = 50
CALL_TIMEOUT_S = 0.2  # the first attempt's call waits this long, then times out
RECHECK_S = 0.5  # later attempts: the operation's next status check is this far off

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


# --- what a phase cost ---------------------------------------------------------------------


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, every process, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


class Window:
    """From the first processed message to the last: this process's CPU and the machine's."""

    def start(self) -> None:
        self.wall = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu = usage.ru_utime + usage.ru_stime
        self.ticks = cpu_ticks()

    def stop(self) -> tuple[float, float, float]:
        """(seconds, cores this process used, fraction of the machine busy)."""
        took = time.perf_counter() - self.wall
        usage = resource.getrusage(resource.RUSAGE_SELF)
        busy, total = cpu_ticks()
        cores = (usage.ru_utime + usage.ru_stime - self.cpu) / took if took > 0 else math.nan
        return took, cores, (busy - self.ticks[0]) / max(1, total - self.ticks[1])


@dataclass
class Rate:
    per_s: float
    cores: float
    busy: float
    seconds: float = math.nan  # from the first processed message to the last


# --- the workload ----------------------------------------------------------------------------


def produce(bootstrap: str, topic: str, n: int, partition: int | None = None) -> None:
    """*n* orders to *topic*, spread by key, or all to *partition* when given."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=262_144)
    for i in range(n):
        payload = json.dumps({"n": i, "item": "widget", "qty": 3}).encode()
        producer.send(
            topic,
            key=f"customer-{i % 200}".encode(),
            value=payload,
            headers=[("message-id", str(uuid.uuid4()).encode()), ("message-type", b"order")],
            partition=partition,
        )
    producer.flush(timeout=120)
    producer.close()


def raw_rate(bootstrap: str, topic: str, n: int, max_poll_records: int) -> Rate:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"raw-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=max_poll_records,
    )
    seen, window = 0, Window()
    deadline = time.monotonic() + 600
    try:
        while seen < n and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                if not seen:
                    window.start()
                seen += len(batch)
        took, cores, busy = window.stop()
    finally:
        consumer.close(autocommit=False)
    return Rate((seen - 1) / took if took > 0 else math.nan, cores, busy)


def consumer_rate(
    url: str,
    bootstrap: str,
    topic: str,
    n: int,
    *,
    mode: str,
    batch_handler: bool,
    max_poll_records: int,
) -> Rate:
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
    rate, done = run_until(runner, topic, n, limit_s=900)
    if done < n:
        raise SystemExit(f"{mode} consumer did not process {n} messages in 900 s")
    return rate


def run_until(
    runner: Runner,
    topic: str,
    n: int,
    *,
    limit_s: float,
    began: threading.Event | None = None,
) -> tuple[Rate, float]:
    """Run *runner* until it processed *n* messages of *topic* or *limit_s* passed.

    The rate counts from the first processed message (or from *began*, set by the handler
    when it is first called) to the last; start-up and group join are excluded. The second
    value is how many were processed. A run cut by the limit is measured up to the limit:
    a consumer held up for good gets a rate, not an endless wait.
    """
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    counter = runner.metrics.processed.labels(topic)
    started, first_count, window = False, 0.0, Window()
    deadline = time.monotonic() + limit_s
    done = 0.0
    try:
        while time.monotonic() < deadline:
            done = counter._value.get()
            if not started and (done > 0 if began is None else began.is_set()):
                # From *began* on, everything processed counts (none was before it).
                started, first_count = True, done if began is None else 0.0
                window.start()
            if done >= n:
                break
            time.sleep(0.005)
        if not started:
            return Rate(0.0, math.nan, math.nan, limit_s), done
        took, cores, busy = window.stop()
        return Rate((done - first_count) / took if took > 0 else math.nan, cores, busy,
                    took), done
    finally:
        runner.stop()
        thread.join(timeout=60)


@dataclass
class IsolationRun:
    """A run of (e): partitions 1 to 3's rate, and what happened on partition 0."""

    rate: Rate
    processed: float  # messages of partitions 1 to 3 (partition 0's never succeed)
    attempts: float  # failed attempts, all on partition 0
    dead_lettered: float


def isolation_rate(
    url: str,
    bootstrap: str,
    topic: str,
    k: int,
    *,
    limit_s: float,
    max_poll_records: int,
) -> IsolationRun:
    """(e): partitions 1 to 3's *k* messages each, one INSERT per message (b's handler).

    Messages of partition 0 (only on the stuck topic) model a supplier that hangs, seen
    through the operations ledger: the first attempt of each blocks for the call's timeout,
    every attempt asks to be retried when the operation's status check is due. None ever
    succeeds, so ``processed`` counts partitions 1 to 3 alone.

    The rate counts from the handler's first call, not from the first message processed:
    partition 0's call timeout then always falls inside the measured time, whichever
    partition the first poll returns first (with the other start, it fell inside only when
    partition 0 came after another partition's batch).
    """
    with create_engine(sqlalchemy_url(url)).begin() as conn:
        conn.execute(text("TRUNCATE public.bench_effects, outboxkit.consumer_inbox"))
    settings = ConsumerSettings(
        database_url=sqlalchemy_url(url),
        kafka_bootstrap=bootstrap,
        mode="batch",
        max_poll_records=max_poll_records,
        dedup_retention_seconds=0,
        # Nothing may be dead-lettered during the phase: partition 0 must stay stuck.
        max_attempts=1000,
        backoff_max_seconds=RECHECK_S,
    )
    app = Consumer(f"bench-iso-{uuid.uuid4().hex[:8]}", settings=settings)
    called: set[str] = set()  # handler thread only
    began = threading.Event()

    def write_one(ctx: HandlerContext, order: Order) -> None:
        if not began.is_set():
            began.set()
        if ctx.partition == STUCK_PARTITION:
            if ctx.message_id not in called:
                called.add(ctx.message_id)
                time.sleep(CALL_TIMEOUT_S)  # the supplier never answers this call
            raise RetryLater("supplier hangs", RECHECK_S)
        ctx.conn.execute(insert(effects), {"message_id": ctx.message_id, "n": order.n})

    app.register(topic, Order, write_one)
    runner = Runner(app)
    rate, processed = run_until(runner, topic, 3 * k, limit_s=limit_s, began=began)
    return IsolationRun(
        rate,
        processed,
        runner.metrics.failures.labels(topic)._value.get(),
        runner.metrics.dead_lettered.labels(topic)._value.get(),
    )


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
    p.add_argument(
        "--n-isolation",
        type=int,
        help="messages per partition (1 to 3) for (e) (default 5,000; quick 1,000)",
    )
    p.add_argument("--max-poll-records", type=int, default=500, help="batch size of all runs")
    p.add_argument("--rounds", type=int, help="rounds of (a)-(c), (e) (default 3; quick 1)")
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


@dataclass
class Results:
    raw: list[Rate]
    batch: list[Rate]
    batch_handler: list[Rate]
    per_message: Rate
    isolation_baseline: list[Rate]
    isolation_stuck: list[IsolationRun]


def measure(
    admin_url: str, bootstrap: str, n: int, n_pm: int, mpr: int, *, k: int, rounds: int
) -> Results:
    """(a) to (e), in a database and topics of their own, dropped at the end."""
    name = f"consumerbench_{uuid.uuid4().hex[:8]}"
    topic = f"bench-orders-{uuid.uuid4().hex[:6]}"
    # (e): partition 0 idle, and partition 0 hanging; the same work on partitions 1 to 3.
    idle = f"bench-iso-idle-{uuid.uuid4().hex[:6]}"
    stuck = f"bench-iso-stuck-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin_url, name)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    results = Results([], [], [], Rate(math.nan, math.nan, math.nan), [], [])
    try:
        engine = create_engine(sqlalchemy_url(url))
        migrate(engine)
        with engine.begin() as conn:
            effects.create(conn)
        engine.dispose()
        admin.create_topics([NewTopic(topic, 3, 1), NewTopic(idle, 4, 1), NewTopic(stuck, 4, 1)])
        log(f"producing {n:,} messages to {topic}")
        produce(bootstrap, topic, n)
        log(f"producing {k:,} messages to each of partitions 1-3 of {idle} and {stuck}, "
            f"{STUCK_MESSAGES} to partition {STUCK_PARTITION} of {stuck}")
        produce(bootstrap, stuck, STUCK_MESSAGES, STUCK_PARTITION)
        for partition in (1, 2, 3):
            produce(bootstrap, idle, k, partition)
            produce(bootstrap, stuck, k, partition)
        for round_ in range(1, rounds + 1):
            log(f"round {round_}/{rounds}: (a) raw kafka-python consumer")
            results.raw.append(raw_rate(bootstrap, topic, n, mpr))
            log(f"round {round_}/{rounds}: (b) batch mode, per-message handler")
            results.batch.append(consumer_rate(
                url, bootstrap, topic, n, mode="batch", batch_handler=False, max_poll_records=mpr
            ))
            log(f"round {round_}/{rounds}: (c) batch mode, batch handler")
            results.batch_handler.append(consumer_rate(
                url, bootstrap, topic, n, mode="batch", batch_handler=True, max_poll_records=mpr
            ))
            log(f"round {round_}/{rounds}: (e) retry isolation, partition 0 idle")
            baseline = isolation_rate(url, bootstrap, idle, k, limit_s=900, max_poll_records=mpr)
            if baseline.processed < 3 * k or baseline.attempts:
                raise SystemExit(
                    f"(e) with partition 0 idle processed {baseline.processed:.0f} of "
                    f"{3 * k} messages in 900 s with {baseline.attempts:.0f} failed attempts"
                )
            results.isolation_baseline.append(baseline.rate)
            log(f"round {round_}/{rounds}: (e) retry isolation, partition 0 hanging")
            # A consumer held up by the hanging partition gets a (low) rate, not an hour.
            limit = 30 + 20 * baseline.rate.seconds
            held = isolation_rate(url, bootstrap, stuck, k, limit_s=limit, max_poll_records=mpr)
            if not held.attempts or held.dead_lettered:
                raise SystemExit(
                    f"(e) partition {STUCK_PARTITION} was not held up as planned "
                    f"({held.attempts:.0f} attempts, {held.dead_lettered:.0f} dead-lettered): "
                    "the figure would measure nothing"
                )
            results.isolation_stuck.append(held)
        log(f"(d) per-message mode on {n_pm:,} messages")
        results.per_message = consumer_rate(
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
            admin.delete_topics([topic, idle, stuck])
        admin.close()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return results


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def spent(rates: Sequence[Rate]) -> str:
    """What the phase cost, as a note: this process's cores and the machine's load."""
    return (f"{median([r.cores for r in rates]):.2f} cores here, machine "
            f"{median([r.busy for r in rates]):.0%} busy")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    n = args.n or (10_000 if args.quick else 50_000)
    n_pm = min(n, args.n_per_message or (1_000 if args.quick else 3_000))
    k = args.n_isolation or (1_000 if args.quick else 5_000)
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
        rounds = args.rounds or (1 if args.quick else 3)
        try:
            results = measure(admin_url, bootstrap, n, n_pm, mpr, k=k, rounds=rounds)
        finally:
            restore()
    machine["loadavg_end"] = os.getloadavg()
    goal = f">= {GOAL_RATIO} x raw"
    raw = median([r.per_s for r in results.raw])
    batch = median([r.per_s for r in results.batch])
    batch_handler = median([r.per_s for r in results.batch_handler])
    per_message = results.per_message.per_s
    # Each round's consumer against the ceiling measured just before it.
    batch_ratio = median([b.per_s / a.per_s for a, b in zip(results.raw, results.batch,
                                                            strict=True)])
    handler_ratio = median([c.per_s / a.per_s for a, c in zip(results.raw,
                                                              results.batch_handler, strict=True)])
    stuck_rates = [s.rate for s in results.isolation_stuck]
    isolated = median([r.per_s for r in stuck_rates])
    isolation_ceiling = median([r.per_s for r in results.isolation_baseline])
    isolation_ratios = [s.per_s / b.per_s for b, s in zip(results.isolation_baseline,
                                                          stuck_rates, strict=True)]
    isolation_ratio = median(isolation_ratios)
    attempts = median([s.attempts for s in results.isolation_stuck])
    cut = sum(s.processed < 3 * k for s in results.isolation_stuck)
    figures = [
        Figure("consumer.raw_msgs_per_s", raw, "msg/s",
               note=f"kafka-python poll only; {spent(results.raw)}"),
        Figure(
            "consumer.batch_msgs_per_s",
            batch,
            "msg/s",
            raw,
            batch_ratio,
            note=f"per-message handler, one INSERT each; {spent(results.batch)}",
        ),
        Figure(
            "consumer.batch_ratio",
            batch_ratio,
            "x",
            1.0,
            batch_ratio,
            goal,
            batch_ratio >= GOAL_RATIO,
        ),
        Figure(
            "consumer.batch_handler_msgs_per_s",
            batch_handler,
            "msg/s",
            raw,
            handler_ratio,
            goal,
            handler_ratio >= GOAL_RATIO,
            note=f"batch handler, one INSERT ... unnest per poll batch; "
                 f"{spent(results.batch_handler)}",
        ),
        Figure(
            "consumer.per_message_msgs_per_s",
            per_message,
            "msg/s",
            raw,
            per_message / raw,
            note=f"one transaction per message, {n_pm} messages; "
                 f"{spent([results.per_message])}",
        ),
        Figure(
            "consumer.retry_isolation_msgs_per_s",
            isolated,
            "msg/s",
            isolation_ceiling,
            isolation_ratio,
            note=f"partitions 1-3 ({k:,} each, b's handler) while partition 0's supplier "
                 f"hangs ({attempts:.0f} attempts there, median; none dead-lettered"
                 f"{f'; {cut} run(s) cut short, still held up' if cut else ''}); "
                 f"ceiling = the same with partition 0 idle; {spent(stuck_rates)}; "
                 f"ceiling {spent(results.isolation_baseline)}",
        ),
        Figure(
            "consumer.retry_isolation_ratio",
            isolation_ratio,
            "x",
            1.0,
            isolation_ratio,
            f">= {GOAL_ISOLATION} x",
            isolation_ratio >= GOAL_ISOLATION,
            note="other partitions' throughput with one partition's outside system hanging, "
                 "against normal; median of the rounds' ratios "
                 f"({', '.join(f'{r:.3f}' for r in isolation_ratios)})",
        ),
    ]
    cpus = os.cpu_count() or 1
    for prefix, rates in (
        ("consumer.raw", results.raw),
        ("consumer.batch", results.batch),
        ("consumer.batch_handler", results.batch_handler),
    ):
        figures += cpu_budget(prefix, [Spent(r.per_s, r.cores, r.busy) for r in rates], raw, cpus)
    print(
        f"\nmachine: {machine['cpus']} cpus ({machine['cpu_model']}), load avg at start "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_end'])}; PostgreSQL "
        f"{machine['postgres']} ({durability}), kafka-python {machine['kafka_python']}; "
        f"N={n:,} (per-message {n_pm:,}, isolation {k:,} x 3), max_poll_records={mpr}, "
        f"{rounds} rounds (medians)\n"
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
