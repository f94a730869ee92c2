"""What the idempotent consumer delivers, against what each Kafka client's consumer alone can do.

One run, one machine, one broker, durable PostgreSQL (a throwaway cluster started here with
``outbox.testing.services.LocalServices``, then fsync, synchronous_commit and
full_page_writes turned on with ALTER SYSTEM and checked with SHOW; stopped at the end).
For each client of ``--clients`` (kafka-python and confluent-kafka by default; the toolkit's
consumer is switched with ``OUTBOXKIT_KAFKA_CLIENT``, as a user would; a client whose backend
is missing is skipped with a note), side by side in the same run:

(a) ceiling: the client's raw consumer (kafka-python's ``KafkaConsumer``, confluent-kafka's
    ``Consumer``, no auto commit) polls the N messages of a 3-partition topic and does
    nothing with them;
(n) batch mode with a handler that does nothing: the toolkit's own share (decoding, the
    dedup marks, the transaction, offsets);
(b) batch mode: ``consumers.Runner`` with a per-message handler that inserts one row with
    ``ctx.conn.execute`` (the README's shape; the marks in one statement, a round trip per
    INSERT);
(f) batch mode, the same handler deferring its row with ``ctx.defer_insert`` (the README's
    fast way: the batch's rows in one statement before the commit);
(c) batch mode with a batch handler that defers each message's row with
    ``ctx.defer_insert`` (the batch's rows in one statement);
(e) kafka-python only: retry isolation: two 4-partition topics with the same
    ``--n-isolation`` messages on partitions 1 to 3 (b's handler); on the second, partition
    0 also holds 50 messages whose supplier hangs (the first attempt waits out a 0.2 s call
    timeout, every attempt asks to ``RetryLater(..., 0.5)``, as ``Ledger.perform`` answers
    while an unknown operation's next status check is not due).
    ``consumer.retry_isolation_ratio``: partitions 1 to 3's rate with partition 0 stuck
    against their rate with partition 0 idle, both counted from the handler's first call
    (so the one call timeout is always inside).

Each is a fresh consumer group reading the same topic; rates are measured from the first
processed message to the last (start-up and group join excluded). (a) to (c), (f) and (e) run in
``--rounds`` alternating rounds (default 3) and their medians are reported, the ratios as
the median of each round's ratio (the ceiling and the consumer measured side by side). Each
phase also records how many cores this process used and how busy the whole machine was: on a
shared machine that tells a slow consumer from a starved one. kafka-python's figures keep
their names (``consumer.batch_ratio``, ...); confluent-kafka's are ``consumer.confluent.*``.

Or give ``--database-url`` and ``--kafka-bootstrap`` to use existing services: the benchmark
then works in a database and a topic of its own, dropped at the end, and restores the
server's durability settings.

    OUTBOXKIT_KAFKA_LIBS=/tmp/kjars/libs .venv/bin/python bench/consumer_bench.py \
        [--quick] [--n N] [--n-isolation K] [--rounds R] [--clients kafka-python,confluent] \
        [--no-isolation] [--json results.json]
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import throwaway  # bench/throwaway.py (this folder is on sys.path)
from durable import make_durable  # bench/durable.py (this folder is on sys.path)
from figures import (  # bench/figures.py (on sys.path)
    Figure,
    Spent,
    confluent_version,
    cpu_budget,
    print_table,
)
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, Table, Text, create_engine, insert, text

from consumers import Consumer, ConsumerSettings, HandlerContext, RetryLater, Runner
from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate
from outbox.messages.ids import uuid7

CLIENTS = ("kafka-python", "confluent")
PHASES = ("noop", "one", "deferred", "batch")  # (n), (b), (f), (c): the handlers
# Issue 15's goals. kafka-python, against its raw consumer: the README's per-message handler
# in batch mode (consumer.batch_ratio) and a batch handler. confluent-kafka (its raw consumer
# is several times faster, so PostgreSQL is the limit): absolute rates.
GOAL_BATCH_RATIO = 0.25
GOAL_HANDLER_RATIO = 0.5
GOAL_CONFLUENT_BATCH = 15_000.0
GOAL_CONFLUENT_HANDLER = 30_000.0
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


class BackendCpu:
    """CPU seconds the client backends of one database spent (PostgreSQL on this machine:
    /proc/<pid>/stat): the consumer's connections, not the other databases' work. Its own
    connection is opened before the measured window (start() and stop() only query)."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.before: dict[int, float] = {}

    def _pids(self) -> list[int]:
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()").fetchall()
        return [row[0] for row in rows]

    @staticmethod
    def _cpu(pid: int) -> float | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None  # not on this machine, or gone
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self.before = {pid: cpu for pid in self._pids()
                       if (cpu := self._cpu(pid)) is not None}

    def stop(self) -> float:
        """CPU seconds since start() (a backend that ended meanwhile is not counted)."""
        total = 0.0
        for pid in self._pids():
            cpu = self._cpu(pid)
            if cpu is not None:
                total += cpu - self.before.get(pid, 0.0)
        return total if self.before or total else math.nan

    def close(self) -> None:
        self.conn.close()


@dataclass
class Rate:
    per_s: float
    cores: float
    busy: float
    seconds: float = math.nan  # from the first processed message to the last
    db_cpu_s: float = math.nan  # CPU of the consumer's PostgreSQL backends meanwhile


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
            # The ids outboxkit's emit gives (time-ordered), so the marks cost what they will.
            headers=[("message-id", str(uuid7()).encode()), ("message-type", b"order")],
            partition=partition,
        )
    producer.flush(timeout=120)
    producer.close()


def missing_backend(client: str) -> str | None:
    """Why the toolkit cannot run with *client* here (None: it can)."""
    if client == "kafka-python":
        return None
    try:
        import confluent_kafka  # noqa: F401, PLC0415

        import outbox.kafka.confluent  # noqa: F401, PLC0415
    except ImportError as exc:
        return f"its backend is not installed ({exc})"
    return None


@contextlib.contextmanager
def kafka_client(client: str) -> Iterator[None]:
    """``OUTBOXKIT_KAFKA_CLIENT=client`` for the block: how a user picks the toolkit's client."""
    before = os.environ.get("OUTBOXKIT_KAFKA_CLIENT")
    os.environ["OUTBOXKIT_KAFKA_CLIENT"] = client
    try:
        yield
    finally:
        if before is None:
            del os.environ["OUTBOXKIT_KAFKA_CLIENT"]
        else:
            os.environ["OUTBOXKIT_KAFKA_CLIENT"] = before


def raw_rate(client: str, bootstrap: str, topic: str, n: int, max_poll_records: int) -> Rate:
    """(a): *client*'s own consumer reads the *n* messages and does nothing with them."""
    if client == "confluent":
        return raw_rate_confluent(bootstrap, topic, n, max_poll_records)
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


def raw_rate_confluent(bootstrap: str, topic: str, n: int, max_poll_records: int) -> Rate:
    from confluent_kafka import Consumer as ConfluentConsumer  # noqa: PLC0415

    consumer = ConfluentConsumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"raw-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
    })
    consumer.subscribe([topic])
    seen, window = 0, Window()
    deadline = time.monotonic() + 600
    try:
        while seen < n and time.monotonic() < deadline:
            messages = consumer.consume(num_messages=max_poll_records, timeout=0.5)
            good = sum(1 for m in messages if m.error() is None)
            if good and not seen:
                window.start()
            seen += good
        took, cores, busy = window.stop()
    finally:
        consumer.close()
    return Rate((seen - 1) / took if took > 0 else math.nan, cores, busy)


def consumer_rate(
    url: str,
    bootstrap: str,
    topic: str,
    n: int,
    *,
    client: str,
    mode: str,
    handler: str,
    max_poll_records: int,
) -> Rate:
    """The toolkit's consumer with *client*; *handler*: "noop", "one" (an INSERT per
    message, the README's shape), "deferred" (the same row through ``ctx.defer_insert``)
    or "batch" (a batch handler deferring the same rows: one INSERT per poll batch)."""
    with create_engine(sqlalchemy_url(url)).begin() as conn:
        conn.execute(text("TRUNCATE public.bench_effects, outboxkit.consumer_inbox"))
    settings = ConsumerSettings(
        database_url=sqlalchemy_url(url),
        kafka_bootstrap=bootstrap,
        mode=mode,
        max_poll_records=max_poll_records,
        dedup_retention_seconds=0,
    )
    app = Consumer(f"bench-{uuid.uuid4().hex[:8]}", settings=settings)
    if handler == "noop":

        def do_nothing(ctx: HandlerContext, order: Order) -> None:
            pass

        app.register(topic, do_nothing)
    elif handler == "batch":

        def write_batch(batch: Sequence[tuple[HandlerContext, Order]]) -> None:
            # The batch's rows in one statement, as the docs advise: deferred, the consumer
            # sends them as one array literal per column. (Until 2026-12-06 this handler
            # wrote its own INSERT ... unnest with Python lists as parameters: psycopg
            # dumped them element by element, a quarter of the handler thread.)
            for ctx, order in batch:
                ctx.defer_insert(effects, {"message_id": ctx.message_id, "n": order.n})

        app.register_batch(topic, write_batch)
    elif handler == "deferred":

        def defer_one(ctx: HandlerContext, order: Order) -> None:
            ctx.defer_insert(effects, {"message_id": ctx.message_id, "n": order.n})

        app.register(topic, defer_one)
    else:

        def write_one(ctx: HandlerContext, order: Order) -> None:
            ctx.conn.execute(insert(effects), {"message_id": ctx.message_id, "n": order.n})

        app.register(topic, write_one)
    with kafka_client(client):  # for the whole run: the runner may resolve it late
        # As `outbox consume` runs it (a process of its own: with kafka-python, a 0.5 ms
        # thread switch interval while it runs; put back after, for the raw consumers).
        runner = Runner(app, own_process=True)
        rate, done = run_until(runner, topic, n, limit_s=900, url=url)
    if done < n:
        raise SystemExit(f"{mode} consumer ({client}) did not process {n} messages in 900 s")
    return rate


def run_until(
    runner: Runner,
    topic: str,
    n: int,
    *,
    limit_s: float,
    began: threading.Event | None = None,
    url: str | None = None,
) -> tuple[Rate, float]:
    """Run *runner* until it processed *n* messages of *topic* or *limit_s* passed.

    The rate counts from the first processed message (or from *began*, set by the handler
    when it is first called) to the last; start-up and group join are excluded. The second
    value is how many were processed. A run cut by the limit is measured up to the limit:
    a consumer held up for good gets a rate, not an endless wait.
    """
    backends = BackendCpu(url) if url else None  # connected before the window, not in it
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
                if backends is not None:
                    backends.start()
            if done >= n:
                break
            time.sleep(0.005)
        if not started:
            return Rate(0.0, math.nan, math.nan, limit_s), done
        took, cores, busy = window.stop()
        db_cpu = backends.stop() if backends is not None else math.nan
        return Rate((done - first_count) / took if took > 0 else math.nan, cores, busy,
                    took, db_cpu), done
    finally:
        runner.stop()
        thread.join(timeout=60)
        if backends is not None:
            backends.close()


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

    app.register(topic, write_one)
    with kafka_client("kafka-python"):
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
        "confluent_kafka": confluent_version(),
        "kafka_bootstrap": bootstrap,
        "loadavg_start": os.getloadavg(),
    }




def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small N: a smoke run")
    p.add_argument("--n", type=int, help="messages for (a)-(c) (default 50,000; quick 10,000)")
    p.add_argument(
        "--n-isolation",
        type=int,
        help="messages per partition (1 to 3) for (e) (default 5,000; quick 1,000)",
    )
    p.add_argument("--max-poll-records", type=int, default=500, help="batch size of all runs")
    p.add_argument("--rounds", type=int, help="rounds of (a)-(c), (e) (default 3; quick 1)")
    p.add_argument(
        "--clients",
        default=",".join(CLIENTS),
        help="Kafka clients to measure, comma separated (default: kafka-python,confluent); "
        "one whose backend is missing is skipped with a note",
    )
    p.add_argument("--no-isolation", action="store_true", help="skip (e): a shorter run")
    p.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="of (n), (b), (f), (c), which to run, comma separated: noop, one, deferred, "
        "batch (default all; (a) always runs, the ratios' ceiling)",
    )
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
    args = p.parse_args(argv)
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    args.phases = [c.strip() for c in args.phases.split(",") if c.strip()]
    if set(args.phases) - set(PHASES):
        p.error(f"--phases takes {', '.join(PHASES)}")
    unknown = sorted(set(args.clients) - set(CLIENTS))
    if unknown or not args.clients:
        p.error(f"--clients takes {' and/or '.join(CLIENTS)}, not {', '.join(unknown) or '{}'}")
    return args


@dataclass
class ClientResults:
    """(a) to (c), (n), (f) with one Kafka client (per-message mode: bench/keyed_bench.py)."""

    raw: list[Rate] = field(default_factory=list)
    noop: list[Rate] = field(default_factory=list)
    batch: list[Rate] = field(default_factory=list)
    deferred: list[Rate] = field(default_factory=list)
    batch_handler: list[Rate] = field(default_factory=list)


@dataclass
class Results:
    clients: dict[str, ClientResults] = field(default_factory=dict)
    isolation_baseline: list[Rate] = field(default_factory=list)
    isolation_stuck: list[IsolationRun] = field(default_factory=list)


def isolation_round(
    results: Results,
    *,
    url: str,
    bootstrap: str,
    topics: tuple[str, str],
    k: int,
    mpr: int,
    round_: int,
    rounds: int,
) -> None:
    """One round of (e): partition 0 idle, then hanging (kafka-python)."""
    idle, stuck = topics
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


def measure(
    admin_url: str,
    bootstrap: str,
    n: int,
    mpr: int,
    *,
    k: int,
    rounds: int,
    clients: Sequence[str],
    isolation: bool,
    phases: Sequence[str] = PHASES,
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
    results = Results({client: ClientResults() for client in clients})
    isolation = isolation and "kafka-python" in clients
    try:
        engine = create_engine(sqlalchemy_url(url))
        migrate(engine)
        with engine.begin() as db:
            effects.create(db)
        engine.dispose()
        admin.create_topics([NewTopic(topic, 3, 1), NewTopic(idle, 4, 1), NewTopic(stuck, 4, 1)])
        log(f"producing {n:,} messages to {topic}")
        produce(bootstrap, topic, n)
        if isolation:
            log(f"producing {k:,} messages to each of partitions 1-3 of {idle} and {stuck}, "
                f"{STUCK_MESSAGES} to partition {STUCK_PARTITION} of {stuck}")
            produce(bootstrap, stuck, STUCK_MESSAGES, STUCK_PARTITION)
            for partition in (1, 2, 3):
                produce(bootstrap, idle, k, partition)
                produce(bootstrap, stuck, k, partition)
        for round_ in range(1, rounds + 1):
            for client, mine in results.clients.items():
                def rate(handler: str, client: str = client) -> Rate:
                    return consumer_rate(url, bootstrap, topic, n, client=client, mode="batch",
                                         handler=handler, max_poll_records=mpr)

                log(f"round {round_}/{rounds}: (a) raw {client} consumer")
                mine.raw.append(raw_rate(client, bootstrap, topic, n, mpr))
                for phase, label, into in (
                    ("noop", "(n) {}, batch mode, no-op handler", mine.noop),
                    ("one", "(b) {}, batch mode, per-message handler", mine.batch),
                    ("deferred", "(f) {}, batch mode, per-message handler, ctx.defer_insert",
                     mine.deferred),
                    ("batch", "(c) {}, batch mode, batch handler", mine.batch_handler),
                ):
                    if phase in phases:
                        log(f"round {round_}/{rounds}: {label.format(client)}")
                        into.append(rate(phase))
            if isolation:
                isolation_round(results, url=url, bootstrap=bootstrap, topics=(idle, stuck), k=k,
                                mpr=mpr, round_=round_, rounds=rounds)
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


def ratio_of(ceilings: Sequence[Rate], rates: Sequence[Rate]) -> float:
    """The median of each round's ratio (the ceiling measured just before the consumer)."""
    if not rates:
        return math.nan  # a phase not run (--phases)
    return median([b.per_s / a.per_s for a, b in zip(ceilings, rates, strict=True)])


def client_figures(client: str, mine: ClientResults, cpus: int) -> list[Figure]:
    """(a) to (d) of one client: kafka-python's under the names they always had."""
    prefix = "consumer" if client == "kafka-python" else f"consumer.{client.replace('-', '_')}"
    raw = median([r.per_s for r in mine.raw])
    noop = median([r.per_s for r in mine.noop])
    batch = median([r.per_s for r in mine.batch])
    deferred = median([r.per_s for r in mine.deferred])
    batch_handler = median([r.per_s for r in mine.batch_handler])
    noop_ratio = ratio_of(mine.raw, mine.noop)
    batch_ratio = ratio_of(mine.raw, mine.batch)
    deferred_ratio = ratio_of(mine.raw, mine.deferred)
    handler_ratio = ratio_of(mine.raw, mine.batch_handler)
    batch_goal: tuple[str | None, bool | None]
    handler_goal: tuple[str | None, bool | None]
    if client == "kafka-python":
        batch_goal = (f">= {GOAL_BATCH_RATIO} x raw", batch_ratio >= GOAL_BATCH_RATIO)
        deferred_goal: tuple[str | None, bool | None] = (
            f">= {GOAL_BATCH_RATIO} x raw", deferred_ratio >= GOAL_BATCH_RATIO)
        handler_goal = (f">= {GOAL_HANDLER_RATIO} x raw", handler_ratio >= GOAL_HANDLER_RATIO)
        batch_rate_goal: tuple[str | None, bool | None] = (None, None)
    else:
        batch_goal = deferred_goal = (None, None)
        handler_goal = (f">= {GOAL_CONFLUENT_HANDLER:,.0f} msg/s",
                        batch_handler >= GOAL_CONFLUENT_HANDLER)
        batch_rate_goal = (f">= {GOAL_CONFLUENT_BATCH:,.0f} msg/s",
                           batch >= GOAL_CONFLUENT_BATCH)
    figures = [
        Figure(f"{prefix}.raw_msgs_per_s", raw, "msg/s",
               note=f"{client} poll only, no auto commit; {spent(mine.raw)}"),
        Figure(f"{prefix}.noop_msgs_per_s", noop, "msg/s", raw, noop_ratio,
               note=f"batch mode, a handler that does nothing: the toolkit's own share "
                    f"(decode, dedup marks, transaction, offsets); {spent(mine.noop)}"),
        Figure(f"{prefix}.batch_msgs_per_s", batch, "msg/s", raw, batch_ratio,
               *batch_rate_goal,
               note=f"per-message handler, one INSERT each through ctx.conn (the README's "
                    f"shape); {spent(mine.batch)}"),
        Figure(f"{prefix}.batch_ratio", batch_ratio, "x", 1.0, batch_ratio, *batch_goal),
        Figure(f"{prefix}.deferred_msgs_per_s", deferred, "msg/s", raw, deferred_ratio,
               note=f"the same per-message handler, its row through ctx.defer_insert (the "
                    f"README's fast way); {spent(mine.deferred)}"),
        Figure(f"{prefix}.deferred_ratio", deferred_ratio, "x", 1.0, deferred_ratio,
               *deferred_goal),
        Figure(f"{prefix}.batch_handler_msgs_per_s", batch_handler, "msg/s", raw,
               handler_ratio, *handler_goal,
               note=f"batch handler, its rows deferred: one INSERT ... unnest per poll batch; "
                    f"{spent(mine.batch_handler)}"),
    ]
    for phase, rates in (("raw", mine.raw), ("noop", mine.noop), ("batch", mine.batch),
                         ("deferred", mine.deferred), ("batch_handler", mine.batch_handler)):
        figures += cpu_budget(f"{prefix}.{phase}",
                              [Spent(r.per_s, r.cores, r.busy) for r in rates], raw, cpus)
        # The machine's figure counts whatever else runs on it; this one only this process
        # (the consumer and its Kafka client's threads), which others' load barely moves.
        own = median([r.cores / r.per_s * 1e6 for r in rates if r.per_s > 0])
        figures.append(Figure(f"{prefix}.{phase}.process_cpu_us_per_msg", own, "us",
                              note="this process's CPU per message, median of rounds"))
        if phase != "raw":
            db = median([r.db_cpu_s / (r.per_s * r.seconds) * 1e6 for r in rates
                         if r.per_s > 0 and math.isfinite(r.db_cpu_s)])
            figures.append(Figure(f"{prefix}.{phase}.db_cpu_us_per_msg", db, "us",
                                  note="the consumer's PostgreSQL backends' CPU per message, "
                                       "median of rounds"))
    return figures


def isolation_figures(results: Results, k: int) -> list[Figure]:
    stuck_rates = [s.rate for s in results.isolation_stuck]
    isolated = median([r.per_s for r in stuck_rates])
    isolation_ceiling = median([r.per_s for r in results.isolation_baseline])
    isolation_ratios = [s.per_s / b.per_s for b, s in zip(results.isolation_baseline,
                                                          stuck_rates, strict=True)]
    isolation_ratio = median(isolation_ratios)
    attempts = median([s.attempts for s in results.isolation_stuck])
    cut = sum(s.processed < 3 * k for s in results.isolation_stuck)
    return [
        Figure(
            "consumer.retry_isolation_msgs_per_s",
            isolated,
            "msg/s",
            isolation_ceiling,
            isolation_ratio,
            note=f"kafka-python; partitions 1-3 ({k:,} each, b's handler) while partition 0's "
                 f"supplier hangs ({attempts:.0f} attempts there, median; none dead-lettered"
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


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    n = args.n or (10_000 if args.quick else 50_000)
    k = args.n_isolation or (1_000 if args.quick else 5_000)
    started = datetime.now(UTC)
    mpr = args.max_poll_records
    clients = []
    for client in args.clients:
        why = missing_backend(client)
        if why is None:
            clients.append(client)
        else:
            print(f"note: {client} skipped: {why}", file=sys.stderr, flush=True)
    if not clients:
        raise SystemExit("no Kafka client left to measure")
    with services(args) as (admin_url, bootstrap):
        restore: Callable[[], None]
        durability, restore = (
            ("not checked (--allow-not-durable)", lambda: None)
            if args.allow_not_durable
            else make_durable(admin_url)
        )
        log(f"durability: {durability}")
        machine = machine_info(admin_url, bootstrap)
        rounds = args.rounds or (1 if args.quick else 3)
        try:
            results = measure(admin_url, bootstrap, n, mpr, k=k, rounds=rounds,
                              clients=clients, isolation=not args.no_isolation,
                              phases=args.phases)
        finally:
            restore()
    machine["loadavg_end"] = os.getloadavg()
    machine["clients"] = clients
    cpus = os.cpu_count() or 1
    figures: list[Figure] = []
    for client, mine in results.clients.items():
        figures += client_figures(client, mine, cpus)
    if results.isolation_stuck:
        figures += isolation_figures(results, k)
    print(
        f"\nmachine: {machine['cpus']} cpus ({machine['cpu_model']}), load avg at start "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_end'])}; PostgreSQL "
        f"{machine['postgres']} ({durability}), kafka-python {machine['kafka_python']}, "
        f"confluent-kafka {machine['confluent_kafka']}; clients {', '.join(clients)}; "
        f"N={n:,} (isolation {k:,} x 3), max_poll_records={mpr}, "
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
