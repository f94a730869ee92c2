"""Debezium side by side with the outboxkit relay, on this machine, in the same run.

Debezium: Kafka Connect standalone with the PostgreSQL connector (pgoutput) and the Outbox
Event Router, jars from Maven Central (bench/peers/pom.xml, settings.xml). The relay:
``python -m relay``. Both get the producer settings of the relay's defaults (acks=all,
idempotence, linger and batch size of relay/settings.py) without compression, the same
broker and the same outbox rows; Debezium 5 requests in flight, the relay with
confluent-kafka 1 (docs/relay.md, "A proof is an offset").

One throwaway PostgreSQL (wal_level=logical; fsync, synchronous_commit, full_page_writes
on) is started here; Kafka too, unless --kafka-bootstrap names one. Per round:

1. a fresh replication slot, then N rows in the outbox (1,000 per transaction, by
   generate_series), VACUUM ANALYZE, CHECKPOINT;
2. Debezium streams them from the slot (snapshot.mode=no_data) into ``dbz.<topic>``;
3. the relay drains the same rows into ``<topic>``.

Each drain is done when the topic's end offsets add up to N (polled every 50 ms); its
throughput is timed from the process's spawn and from the first to the last record appended
(the topics stamp LogAppendTime). CPU from /proc: the whole machine (/proc/stat), the
PostgreSQL cluster (every process of it, reaped ones included), the engine's process, the
broker's when it is ours. Then latency: writer processes commit single-message
transactions (outbox.emit) at --rate for --latency-seconds against each engine in turn;
commit-to-appended per message, the first second discarded.

    .venv/bin/python bench/peers/debezium.py [--quick] [--n N] [--json PATH]
        [--kafka-bootstrap HOST:PORT] [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import psycopg

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # bench/: relay_bench's writers

import connect  # noqa: E402 - bench/peers is on sys.path as the script's folder
import measure  # noqa: E402
import topics  # noqa: E402
from relay_bench import Ctx, pct, run_writers  # noqa: E402

from outbox.db.dsn import with_database  # noqa: E402
from outbox.messages.lanes import lane_for  # noqa: E402
from outbox.testing import postgres  # noqa: E402
from outbox.testing.services import LocalServices  # noqa: E402

SCHEMA = "outboxkit"
LANES = 64
KEYS = 1000
SLOT = "outboxkit_bench_debezium"
PUBLICATION = "outboxkit_bench_debezium"
DBZ_PREFIX = "dbz."  # Debezium's topic is this + the row's topic
POLL_S = 0.05


def log(message: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def psql(url: str, statement: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else None


# --- the engines ----------------------------------------------------------------------------


class Engine(Protocol):
    name: str
    started_wall: float

    @property
    def pid(self) -> int: ...

    def check_alive(self) -> None: ...

    def stop(self) -> None: ...


# The relay's Kafka client (--relay-client): confluent-kafka, its fastest, unless asked.
RELAY_CLIENT = ["confluent"]


class Relay:
    """``python -m relay`` as our child, configured through its environment only."""

    name = "relay"

    def __init__(self, url: str, bootstrap: str, logs: Path, label: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
        env |= {
            "OUTBOXKIT_RELAY_DATABASE_URL": url,
            "OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP": bootstrap,
            "OUTBOXKIT_RELAY_RELAY_ID": f"peers-{label}-{uuid.uuid4().hex[:6]}",
            "OUTBOXKIT_RELAY_HTTP_PORT": "0",
            "OUTBOXKIT_RELAY_COMPRESSION": "none",  # as Debezium's producer here
            "OUTBOXKIT_RELAY_KAFKA_CLIENT": RELAY_CLIENT[0],
        }
        self.log_path = logs / f"relay-{label}.log"
        self._log = self.log_path.open("wb")
        self.started_wall = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay"],
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the relay exited with {self.proc.returncode}:\n{tail}")

    def stop(self) -> None:
        """SIGTERM (it hands back its lanes), SIGKILL after 40 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


class Debezium:
    """Kafka Connect standalone running Debezium's connector; a fresh offsets file each time,
    so it starts from the replication slot's position."""

    name = "debezium"

    def __init__(self, run: Run, label: str, extra: dict[str, str] | None = None) -> None:
        worker = connect.worker_config(
            bootstrap=run.bootstrap,
            offsets=run.logs / f"debezium-{label}.offsets",
            producer=run.producer,
        )
        connector = connect.connector_config(
            host="127.0.0.1",
            port=run.pg_port,
            dbname=run.dbname,
            slot=SLOT,
            publication=PUBLICATION,
            topic_prefix=DBZ_PREFIX,
            extra=extra,
        )
        self.connect = connect.Connect(run.jars, run.logs, f"debezium-{label}", worker, connector)
        self.started_wall = self.connect.started_wall

    @property
    def pid(self) -> int:
        return self.connect.proc.pid

    def check_alive(self) -> None:
        self.connect.check_alive()

    def stop(self) -> None:
        self.connect.stop()


# --- the run's state ------------------------------------------------------------------------


@dataclass
class Run:
    url: str  # the benchmark database
    dbname: str
    pg_port: int
    postmaster: int
    bootstrap: str
    broker_pid: int | None
    jars: Path
    logs: Path
    producer: connect.Producer
    prefix: str
    topics: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)  # Debezium's records vs the relay's

    def topic(self, name: str) -> str:
        """A row topic of this run; both engines' Kafka topics for it are made here."""
        row_topic = f"{self.prefix}.{name}"
        made = [row_topic, DBZ_PREFIX + row_topic]
        topics.create(self.bootstrap, made)
        self.topics += made
        return row_topic


def kafka_topic(engine: str, row_topic: str) -> str:
    return DBZ_PREFIX + row_topic if engine == "debezium" else row_topic


def fresh_slot(run: Run) -> None:
    """A new slot: Debezium then streams exactly what is committed from here on."""
    psql(
        run.url,
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
        "WHERE slot_name = %s",
        [SLOT],
    )
    psql(run.url, "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [SLOT])


def empty_outbox(run: Run) -> None:
    psql(run.url, f"TRUNCATE {SCHEMA}.outbox_messages")


def fill(run: Run, row_topic: str, n: int, *, settle: bool = True) -> float:
    """N rows, 1,000 per transaction, by generate_series (emit would take minutes): the
    columns emit writes, ~240-byte JSON payloads, 1,000 keys, each in its lane as emit
    would put it (one key, one lane: the relay keeps a key's order within its lane)."""
    lanes = [lane_for(f"key-{k:04d}".encode(), uuid.uuid4(), LANES) for k in range(KEYS)]
    started = time.monotonic()
    with psycopg.connect(run.url, autocommit=True) as conn:
        for low in range(1, n + 1, 1000):
            conn.execute(
                f"""
                INSERT INTO {SCHEMA}.outbox_messages
                    (message_id, topic, key, lane, message_type, payload)
                SELECT gen_random_uuid(), %(topic)s,
                       convert_to('key-' || lpad((i %% {KEYS})::text, 4, '0'), 'UTF8'),
                       (%(lanes)s::int[])[i %% {KEYS} + 1], 'bench.msg',
                       convert_to('{{"seq":' || i || ',"data":"' || repeat(md5(i::text), 6)
                                  || substr(md5(i::text || 'x'), 1, 18) || '"}}', 'UTF8')
                FROM generate_series(%(low)s::int, %(high)s::int) AS i
                """,
                {"topic": row_topic, "low": low, "high": min(n, low + 999), "lanes": lanes},
            )
    took = time.monotonic() - started
    if settle:  # statistics, visibility map, no checkpoint debt inside a timing
        psql(run.url, f"VACUUM ANALYZE {SCHEMA}.outbox_messages")
        psql(run.url, "CHECKPOINT")
    return took


def wait_for(engine: Engine, counter: topics.Counter, n: int, *, timeout_s: float,
             on_first: Callable[[int], None] | None = None,
             timeline: list[tuple[float, int]] | None = None) -> None:
    """Until *counter* reaches *n* records; *on_first* gets the count first seen above 0;
    *timeline* gets (monotonic time, count) at every poll."""
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    seen = 0
    while seen < n:
        now = time.monotonic()
        if now >= next_check:  # reading the JVM's log every 50 ms would cost CPU we measure
            engine.check_alive()
            next_check = now + 1.0
        if now > deadline:
            raise RuntimeError(
                f"{engine.name} delivered {seen:,} of {n:,} records in {timeout_s:.0f} s"
            )
        time.sleep(POLL_S)
        count = counter.count()
        if count and not seen and on_first:
            on_first(count)
        if timeline is not None:
            timeline.append((time.monotonic(), count))
        seen = count


# --- (1) throughput ------------------------------------------------------------------------


@dataclass
class Drain:
    engine: str
    rows: int
    from_start_s: float = math.nan  # spawn to the last record appended
    first_s: float = math.nan  # spawn to the first record appended
    first_to_last_s: float = math.nan
    # The rate over the second half of the records (polled counts): warm, for a JVM whose
    # JIT compiles the hot paths during the first seconds.
    second_half_rate: float = math.nan
    peak_rss_mb: float = math.nan
    # CPU per message, µs: from spawn (start-up included) and while records flowed
    machine_us: float = math.nan
    machine_us_steady: float = math.nan
    postgres_us: float = math.nan
    postgres_us_steady: float = math.nan
    engine_us: float = math.nan
    engine_us_steady: float = math.nan
    broker_us_steady: float = math.nan
    measured_us_steady: float = math.nan  # PostgreSQL + engine + broker: blind to other load
    machine_busy: float = math.nan  # fraction of both CPUs busy during the drain, anyone's
    others_cores: float = math.nan  # CPU of processes other than PG, engine, broker

    @property
    def rate(self) -> float:
        return self.rows / self.from_start_s

    @property
    def steady_rate(self) -> float:
        return self.rows / self.first_to_last_s


def drain(run: Run, engine_name: str, row_topic: str, n: int, label: str) -> Drain:
    result = Drain(engine_name, n)
    topic = kafka_topic(engine_name, row_topic)
    counter = topics.Counter(run.bootstrap, topic)
    from_spawn = measure.Sampler(run.postmaster, run.broker_pid)
    engine: Engine = (
        Debezium(run, label) if engine_name == "debezium"
        else Relay(run.url, run.bootstrap, run.logs, label)
    )
    steady: list[tuple[measure.Sampler, int]] = []
    timeline: list[tuple[float, int]] = []
    try:
        wait_for(
            engine, counter, n, timeout_s=max(300.0, n / 200),
            on_first=lambda count: steady.append(
                (measure.Sampler(run.postmaster, run.broker_pid, engine.pid), count)
            ),
            timeline=timeline,
        )
        total = from_spawn.cost(engine.pid)
        result.peak_rss_mb = measure.peak_rss_mb(engine.pid)
        sampler, before = steady[0]
        flowing = sampler.cost(engine.pid)
    finally:
        engine.stop()
        counter.close()
    first, last = topics.append_span(run.bootstrap, topic)
    result.first_s = first - engine.started_wall
    result.from_start_s = last - engine.started_wall
    result.first_to_last_s = last - first
    steady_n = n - before
    half = next((t, c) for t, c in timeline if c >= n // 2)
    if half[1] < n:
        result.second_half_rate = (n - half[1]) / (timeline[-1][0] - half[0])
    result.machine_us = total.machine_s / n * 1e6
    result.postgres_us = total.postgres_s / n * 1e6
    result.engine_us = total.engine_s / n * 1e6
    result.machine_us_steady = flowing.machine_s / steady_n * 1e6
    result.postgres_us_steady = flowing.postgres_s / steady_n * 1e6
    result.engine_us_steady = flowing.engine_s / steady_n * 1e6
    result.broker_us_steady = flowing.broker_s / steady_n * 1e6
    broker_s = 0.0 if math.isnan(flowing.broker_s) else flowing.broker_s
    result.measured_us_steady = (flowing.postgres_s + flowing.engine_s + broker_s) / steady_n * 1e6
    result.machine_busy = total.machine_busy
    result.others_cores = total.others_s / total.wall_s
    return result


def show_drain(d: Drain) -> None:
    print(
        f"  {d.engine:<8} {d.rate:>8,.0f} msgs/s from spawn ({d.from_start_s:.1f} s, first "
        f"record at {d.first_s:.1f} s), {d.steady_rate:,.0f} first→last, "
        f"{d.second_half_rate:,.0f} over the second half; CPU µs/msg steady: "
        f"machine {d.machine_us_steady:.0f}, PostgreSQL {d.postgres_us_steady:.1f} (from "
        f"spawn {d.postgres_us:.1f}), engine "
        f"{d.engine_us_steady:.1f}, broker {d.broker_us_steady:.1f}; peak RSS "
        f"{d.peak_rss_mb:.0f} MB; machine {d.machine_busy:.0%} busy, others "
        f"{d.others_cores:.2f} cores",
        flush=True,
    )


# --- (2) latency ---------------------------------------------------------------------------


@dataclass
class Latency:
    engine: str
    label: str
    achieved: float = math.nan
    measured: int = 0
    missing: int = 0
    p50_ms: float = math.nan
    p90_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    machine_us: float = math.nan
    postgres_us: float = math.nan
    engine_us: float = math.nan
    machine_busy: float = math.nan
    others_cores: float = math.nan  # the writers are in here
    kafka_ms: list[float] = field(default_factory=list, repr=False)


WARM_ROWS = 2000


def warm_up(run: Run, engine: Engine, row_topic: str, counter: topics.Counter) -> None:
    """A few thousand rows through the engine before the clock starts: connected, topic
    known, the JVM's hot paths compiled, then idle again."""
    fill(run, row_topic, WARM_ROWS, settle=False)
    wait_for(engine, counter, WARM_ROWS, timeout_s=180)
    time.sleep(2.0)


def latency(run: Run, plan: Plan, engine_name: str, label: str,
            extra: dict[str, str] | None = None) -> Latency:
    result = Latency(engine_name, label)
    row_topic = run.topic("lat-" + re.sub(r"[^A-Za-z0-9._-]", "-", label))
    topic = kafka_topic(engine_name, row_topic)
    empty_outbox(run)
    if engine_name == "debezium":
        fresh_slot(run)
    counter = topics.Counter(run.bootstrap, topic)
    engine: Engine = (
        Debezium(run, f"lat-{label}", extra) if engine_name == "debezium"
        else Relay(run.url, run.bootstrap, run.logs, f"lat-{label}")
    )
    try:
        warm_up(run, engine, row_topic, counter)
        psql(run.url, "CHECKPOINT")
        sampler = measure.Sampler(run.postmaster, run.broker_pid, engine.pid)
        ctx = Ctx(run.url, run.bootstrap, run.prefix, run.logs, quick=plan.quick)
        start_at, committed, _writer_cpu = run_writers(
            ctx, row_topic, plan.rate, plan.latency_s, plan.writers
        )
        last = max(t for _, t in committed)
        cost = sampler.cost(engine.pid)
        wait_for(engine, counter, WARM_ROWS + len(committed), timeout_s=180)
    finally:
        engine.stop()
        counter.close()
    result.achieved = len(committed) / (last - start_at)
    result.machine_us = cost.machine_s / len(committed) * 1e6
    result.postgres_us = cost.postgres_s / len(committed) * 1e6
    result.engine_us = cost.engine_s / len(committed) * 1e6
    result.machine_busy = cost.machine_busy
    result.others_cores = cost.others_s / cost.wall_s
    steady = {mid: t for mid, t in committed if t >= start_at + 1.0}
    appended = topics.append_times(run.bootstrap, topic, set(steady))
    result.missing = len(steady) - len(appended)
    result.kafka_ms = [(appended[m] - t) * 1000 for m, t in steady.items() if m in appended]
    result.measured = len(result.kafka_ms)
    result.p50_ms, result.p90_ms, result.p99_ms = (
        pct(result.kafka_ms, q) for q in (50, 90, 99)
    )
    result.max_ms = max(result.kafka_ms, default=math.nan)
    print(
        f"  {label:<18} achieved {result.achieved:,.0f}/s, {result.measured:,} measured "
        f"({result.missing} missing): p50 {result.p50_ms:.1f} p90 {result.p90_ms:.1f} p99 "
        f"{result.p99_ms:.1f} max {result.max_ms:.1f} ms; CPU µs/msg: machine "
        f"{result.machine_us:.0f}, PostgreSQL {result.postgres_us:.1f}, engine "
        f"{result.engine_us:.1f}; machine {result.machine_busy:.0%} busy, others (writers "
        f"included) {result.others_cores:.2f} cores",
        flush=True,
    )
    return result


# --- the table -------------------------------------------------------------------------------


@dataclass
class Row:
    figure: str
    unit: str
    debezium: float
    relay: float
    note: str = ""

    @property
    def ratio(self) -> float:
        """Debezium over the relay."""
        if self.relay == 0 or math.isnan(self.relay) or math.isnan(self.debezium):
            return math.nan
        return self.debezium / self.relay


def med(values: list[float]) -> float:
    ok = [v for v in values if math.isfinite(v)]
    return statistics.median(ok) if ok else math.nan


def rows_of(drains: list[Drain], lats: dict[str, Latency], rate: float) -> list[Row]:
    def both(attr: str) -> tuple[float, float]:
        return tuple(  # type: ignore[return-value]
            med([getattr(d, attr) for d in drains if d.engine == e])
            for e in ("debezium", "relay")
        )

    def rate_of(engine: str, steady: bool) -> float:
        return med([d.steady_rate if steady else d.rate for d in drains if d.engine == engine])

    dbz, rel = lats.get("debezium", Latency("debezium", "")), lats.get("relay", Latency("", ""))
    tuned = lats.get("debezium-tuned")
    rows = [
        Row("throughput from spawn", "msgs/s", rate_of("debezium", False), rate_of("relay", False),
            "spawn to last record appended; median of rounds"),
        Row("throughput first→last record", "msgs/s", rate_of("debezium", True),
            rate_of("relay", True), "first to last LogAppendTime"),
        Row("throughput, second half of the records", "msgs/s", *both("second_half_rate"),
            "warm (JIT compiled); from polled counts"),
        Row("first record after spawn", "s", *both("first_s")),
        Row("machine CPU per message", "µs", *both("machine_us_steady"),
            "every process (/proc/stat) while records flowed"),
        Row("machine CPU per message, start-up included", "µs", *both("machine_us")),
        Row("PostgreSQL + engine + broker CPU per message", "µs", *both("measured_us_steady"),
            "the processes measured, while records flowed: blind to other load"),
        Row("PostgreSQL CPU per message", "µs", *both("postgres_us"),
            "every process of the cluster, spawn to done (a WAL sender may decode ahead)"),
        Row("engine CPU per message", "µs", *both("engine_us_steady"),
            "Connect's JVM / the relay's process, while records flowed"),
        Row("engine CPU per message, start-up included", "µs", *both("engine_us")),
        Row("broker CPU per message", "µs", *both("broker_us_steady")),
        Row("peak RSS draining", "MB", *both("peak_rss_mb"), "VmHWM"),
        Row(f"latency p50 at {rate:,.0f} msg/s", "ms", dbz.p50_ms, rel.p50_ms,
            "commit to appended; defaults"),
        Row(f"latency p99 at {rate:,.0f} msg/s", "ms", dbz.p99_ms, rel.p99_ms),
        Row("latency: achieved load", "msgs/s", dbz.achieved, rel.achieved),
        Row("latency: machine CPU per message", "µs", dbz.machine_us, rel.machine_us,
            "the writers' processes, start-up included, count too"),
        Row("latency: PostgreSQL CPU per message", "µs", dbz.postgres_us, rel.postgres_us,
            "the writers' backends, connecting included, count too"),
        Row("latency: engine CPU per message", "µs", dbz.engine_us, rel.engine_us),
    ]
    if tuned:
        rows += [
            Row(f"latency p50, Debezium {tuned.label}", "ms", tuned.p50_ms, rel.p50_ms,
                "relay: defaults"),
            Row(f"latency p99, Debezium {tuned.label}", "ms", tuned.p99_ms, rel.p99_ms),
            Row(f"latency engine CPU per message, Debezium {tuned.label}", "µs",
                tuned.engine_us, rel.engine_us),
        ]
    return rows


def fmt(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def print_table(rows: list[Row]) -> None:
    header = ("figure", "unit", "debezium", "outboxkit relay", "debezium/relay")
    cells = [(r.figure, r.unit, fmt(r.debezium), fmt(r.relay), fmt(r.ratio)) for r in rows]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(line.format(*header))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print(line.format(*c))


# --- services and the run -------------------------------------------------------------------


@dataclass
class Plan:
    quick: bool
    n: int
    rounds: int
    rate: float
    writers: int
    latency_s: float
    tuned_poll_ms: int


def plan_of(args: argparse.Namespace) -> Plan:
    return Plan(
        quick=args.quick,
        n=args.n or (20_000 if args.quick else 200_000),
        rounds=args.rounds or (1 if args.quick else 2),
        rate=args.rate,
        writers=args.writers,
        latency_s=(6.0 if args.quick else 20.0)
        if args.latency_seconds is None
        else args.latency_seconds,
        tuned_poll_ms=args.tuned_poll_ms,
    )


LOGICAL = {
    "wal_level": "logical",
    # Durable: the same commits the relay's benchmark measures (test clusters run fsync=off).
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
}


@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[LocalServices, str, str, int | None]]:
    """Our own PostgreSQL with wal_level=logical, and our own Kafka unless one is given."""
    state = Path(args.state_dir or f"/tmp/outboxkit-peers-{os.getpid()}")  # noqa: S108
    local = LocalServices(state)
    log(f"starting a throwaway PostgreSQL{'' if args.kafka_bootstrap else ' and Kafka'} in {state}")
    try:
        cluster = local.start_postgres()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            for name, value in LOGICAL.items():
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        postgres.stop(local.postgres_dir)  # wal_level needs a restart
        cluster = local.start_postgres(cluster.port)
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            shown = {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in LOGICAL}  # type: ignore[index]
        if shown != LOGICAL:
            raise SystemExit(f"REFUSED: the throwaway cluster says {shown}, not {LOGICAL}")
        if args.kafka_bootstrap:
            bootstrap, broker_pid = args.kafka_bootstrap, None
        else:
            broker = local.start_kafka()
            bootstrap, broker_pid = broker.bootstrap, broker.pid
        yield local, cluster.dsn, bootstrap, broker_pid
    finally:
        local.down()
        if not args.state_dir:
            shutil.rmtree(state, ignore_errors=True)
        log("stopped the throwaway services")


def migrate(url: str) -> None:
    outbox_cli = Path(sys.executable).parent / "outbox"
    result = subprocess.run(
        [str(outbox_cli), "migrate", "--database-url", url],
        capture_output=True, text=True, timeout=300, check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"`outbox migrate` failed: {result.stdout}{result.stderr}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kafka-bootstrap", help="an existing Kafka broker (default: our own)")
    p.add_argument("--state-dir", help="where the throwaway services live (kept if given)")
    p.add_argument("--quick", action="store_true", help="N=20,000, 1 round, 6 s latency")
    p.add_argument("--n", type=int, help="rows per drain (default 200,000; quick 20,000)")
    p.add_argument("--rounds", type=int, help="drain rounds (default 2; quick 1)")
    p.add_argument("--rate", type=float, default=1000.0, help="latency load, msgs/s")
    p.add_argument(
        "--writers", type=int, default=8,
        help="writer processes of the latency load (default 8: a durable commit waits for its "
        "fsync, and 4 did not reach 1,000/s here)",
    )
    p.add_argument("--latency-seconds", type=float, help="default 20; quick 6; 0 skips it")
    p.add_argument(
        "--tuned-poll-ms", type=int, default=10,
        help="Debezium's poll.interval.ms of the extra latency phase (0 skips it; default "
        "10, against Debezium's default 500)",
    )
    p.add_argument(
        "--relay-client", choices=["confluent", "kafka-python"], default="confluent",
        help="the relay's Kafka client (default confluent, its fastest)",
    )
    p.add_argument("--json", help="write the figures and every phase's details here")
    p.add_argument(
        "--keep-topics", action="store_true",
        help="leave the topics in Kafka for inspection (with --kafka-bootstrap)",
    )
    return p.parse_args(argv)


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    before = measure.machine_ticks()
    time.sleep(3)  # what the machine does without us: other sessions' tests, benchmarks
    busy, total = measure.machine_ticks()
    idle_busy = (busy - before[0]) / max(1, total - before[1])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "relay", "outbox"], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.splitlines()
    uncommitted = f" + {len(dirty)} uncommitted files in relay/, outbox/" if dirty else ""
    return {
        "relay_source": head + uncommitted,
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "loadavg_start": os.getloadavg(),
        "busy_before_start": idle_busy,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    RELAY_CLIENT[0] = args.relay_client
    plan = plan_of(args)
    started = datetime.now(UTC)
    t0 = time.monotonic()
    info = machine()
    print(
        f"machine before the run: {info['busy_before_start']:.0%} of {info['cpus']} CPUs busy "
        f"over 3 s (others' work), load average {os.getloadavg()[0]:.2f}; the relay and "
        f"outbox code: {info['relay_source']}",
        flush=True,
    )
    log("Kafka Connect's and Debezium's jars (Maven Central, cached)")
    jars = connect.ensure_jars()
    from relay.settings import RelaySettings  # noqa: PLC0415

    defaults = RelaySettings(kafka_bootstrap="unused:9092")
    # Kafka Connect's producer lingers 5 ms, as in every peer run so far (the relay's own
    # default is its client's: RelaySettings.resolved_linger_ms).
    producer = connect.Producer(5, defaults.producer_batch_bytes, defaults.max_request_bytes)
    logs = Path(f"/tmp/outboxkit-peers-{os.getpid()}-logs")  # noqa: S108
    logs.mkdir(parents=True, exist_ok=True)
    with services(args) as (local, admin_url, bootstrap, broker_pid):
        cluster = postgres.running_cluster(local.postgres_dir)
        assert cluster is not None
        info["postgres"] = psql(admin_url, "SHOW server_version")[0][0]
        dbname = "peers"
        psql(admin_url, f'CREATE DATABASE "{dbname}"')
        url = with_database(admin_url, dbname)
        migrate(url)
        psql(
            url,
            f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {SCHEMA}.outbox_messages "
            "WITH (publish = 'insert')",  # the outbox is insert-only for Debezium
        )
        run = Run(url, dbname, cluster.port, cluster.pid, bootstrap, broker_pid, jars, logs,
                  producer, prefix=f"peers.{uuid.uuid4().hex[:6]}")
        print(
            f"setup: N={plan.n:,} rows per drain, {plan.rounds} round(s), latency "
            f"{plan.rate:,.0f} msgs/s from {plan.writers} writers for {plan.latency_s:.0f} s; "
            f"relay client {RELAY_CLIENT[0]}; producer: acks=all, idempotence, in flight 5 "
            "(Debezium) / 1 (relay, confluent) / 5 (relay, kafka-python), "
            f"linger {producer.linger_ms} ms, "
            f"batch {producer.batch_bytes:,} B, no compression; PostgreSQL {info['postgres']} "
            f"(wal_level=logical, durable); Kafka {bootstrap}; jars {jars}; logs in {logs}",
            flush=True,
        )
        try:
            drains, lats = phases(run, plan)
        finally:
            if not args.keep_topics:
                topics.delete(bootstrap, run.topics)
            with contextlib.suppress(psycopg.Error):  # a slot holds WAL: never leave one
                psql(url, "SELECT pg_drop_replication_slot(%s)", [SLOT])
    info["loadavg_end"] = os.getloadavg()
    rows = rows_of(drains, lats, plan.rate)
    print(
        f"\nmachine: {info['cpus']} cpus ({info['cpu_model']}), "
        f"{info['busy_before_start']:.0%} busy before the run; load average at start "
        f"{', '.join(f'{x:.2f}' for x in info['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in info['loadavg_end'])}; other processes' CPU during "
        f"the drains: {', '.join(f'{d.engine} {d.others_cores:.2f}' for d in drains)} cores; "
        f"run took {time.monotonic() - t0:.0f} s\n"
    )
    print_table(rows)
    if args.json:
        document = {
            "started": started.isoformat(),
            "machine": info,
            "plan": asdict(plan),
            "figures": [{**asdict(r), "ratio": r.ratio} for r in rows],
            "drains": [asdict(d) for d in drains],
            "record_differences": run.differences,
            "latency": {k: {**asdict(v), "kafka_ms": None} for k, v in lats.items()},
        }
        Path(args.json).write_text(json.dumps(document, indent=2, default=str))
        print(f"\nfigures written to {args.json}")
    return 0


def phases(run: Run, plan: Plan) -> tuple[list[Drain], dict[str, Latency]]:
    print(
        "\n(1) drains: per round a fresh slot, N rows, then Debezium streams them from the "
        "slot and the relay drains the same rows"
    )
    drains: list[Drain] = []
    for r in range(1, plan.rounds + 1):
        row_topic = run.topic(f"tput{r}")
        empty_outbox(run)
        fresh_slot(run)
        log(f"round {r}: filling {plan.n:,} rows")
        took = fill(run, row_topic, plan.n)
        log(f"round {r}: filled in {took:.1f} s; Debezium")
        drains.append(drain(run, "debezium", row_topic, plan.n, f"tput{r}"))
        show_drain(drains[-1])
        psql(run.url, "CHECKPOINT")
        log(f"round {r}: the relay")
        drains.append(drain(run, "relay", row_topic, plan.n, f"tput{r}"))
        show_drain(drains[-1])
        problems = topics.differences(run.bootstrap, DBZ_PREFIX + row_topic, row_topic)
        run.differences += problems
        print(
            "  records: " + ("; ".join(problems) if problems else "the same in both topics "
                             "(per-partition counts; partition 0's keys, values, per-key order)"),
            flush=True,
        )
    lats: dict[str, Latency] = {}
    if plan.latency_s <= 0:
        return drains, lats
    print(
        f"\n(2) latency: {plan.writers} writer processes commit single-message transactions "
        f"(outbox.emit) paced to {plan.rate:,.0f}/s for {plan.latency_s:.0f} s; per message "
        "the record's LogAppendTime minus the writer's clock after COMMIT; first second "
        "discarded"
    )
    log("latency: Debezium, defaults")
    lats["debezium"] = latency(run, plan, "debezium", "debezium-defaults")
    log("latency: relay, defaults")
    lats["relay"] = latency(run, plan, "relay", "relay-defaults")
    if plan.tuned_poll_ms:
        log(f"latency: Debezium, poll.interval.ms={plan.tuned_poll_ms}")
        lats["debezium-tuned"] = latency(
            run, plan, "debezium", f"poll.interval.ms={plan.tuned_poll_ms}",
            {"poll.interval.ms": str(plan.tuned_poll_ms)},
        )
    return drains, lats


if __name__ == "__main__":
    raise SystemExit(main())
