"""What the relay delivers, against what the Kafka producer alone can do (issue 4).

One run, one machine, one broker, durable PostgreSQL (fsync, synchronous_commit and
full_page_writes turned on with ALTER SYSTEM for the run, restored afterwards; the run is
refused if that does not take effect):

(a) ceiling: kafka-python's KafkaProducer alone — built by ``relay.publisher.Publisher``, so
    with exactly the relay's producer settings — sends the N rows of the backlog (same
    topic, keys, payload bytes and headers as the relay sends), then flushes;
(b) throughput: one ``python -m relay`` process drains a backlog of the same N rows
    (written by ``outbox.emit.emit`` once, then copied per round); timed from the spawn of
    the process until no row is pending (polled every 50 ms), and from the first published
    batch to the last (no start-up). Rounds of (a) and (b) alternate; medians are reported;
    other batch sizes and linger values run once each;
(c) latency at a steady offered load (single-message transactions from writer processes,
    paced), with NOTIFY (c1) and with the relay deaf to NOTIFY, polling only (c2); and the
    same at a low load (20 msgs/s), where the relay idles between messages;
(d) the cost of one claim (``relay.claims.claim``, 1,000 rows) with 10k vs 1M rows pending;
(e) the relay's peak RSS (VmHWM) draining a small and a large backlog.

Each phase also prints the CPU the relay (and the writers, the producer) used and how busy
the whole machine was meanwhile, everyone's work included: on a shared machine that is
what tells a slow relay from a starved one.

Services: by default a throwaway PostgreSQL and Kafka are started for the run
(``outbox.testing.services.LocalServices``) and stopped at the end; or give
``--database-url`` and ``--kafka-bootstrap`` (the benchmark then works in a database of its
own, created and dropped here, and topics of its own, deleted at the end).

    .venv/bin/python bench/relay_bench.py [--quick] [--n N] [--json results.json] \
        [--samples samples.json]

``--samples`` writes the raw latencies of (c) and the publish timeline of each (b) round,
which ``bench/suite.py`` plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import throwaway  # bench/throwaway.py (this folder is on sys.path)
from durable import make_durable, show  # bench/durable.py (this folder is on sys.path)
from figures import Figure, Spent, cpu_budget, print_table  # bench/figures.py (on sys.path)
from sqlalchemy import Engine, create_engine

from outbox.dsn import sqlalchemy_url, with_database
from outbox.settings import OutboxSettings

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "outboxkit"
LANES = 64
KEYS = 1000
PARTITIONS = 6  # the relay's default topic_partitions
DEAF_CHANNEL = "relaybench_nobody_notifies_here"
POLL_S = 0.05


def log(message: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- durability ---------------------------------------------------------------------------


# --- small helpers ------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def payload_for(i: int) -> dict[str, Any]:
    # ~240 bytes of JSON; hex of random bytes so lz4 does not make it vanish.
    return {"seq": i, "data": os.urandom(105).hex()}


def key_for(i: int) -> str:
    return f"key-{i % KEYS:04d}"


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, every process, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def busy_since(before: tuple[int, int]) -> float:
    """Fraction of all CPUs busy (anyone's work) since *before*."""
    busy, total = cpu_ticks()
    return (busy - before[0]) / max(1, total - before[1])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")
    return math.nan


def psql(url: str, statement: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else None


def pending_exists(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        f"SELECT EXISTS (SELECT 1 FROM {SCHEMA}.outbox_messages WHERE status = 'pending')"
    ).fetchone()
    return bool(row and row[0])


def settle(url: str) -> None:
    """After a fill: statistics, visibility map, and no checkpoint debt inside a timing."""
    psql(url, f"VACUUM ANALYZE {SCHEMA}.outbox_messages")
    psql(url, "CHECKPOINT")


def reset_relays(url: str) -> None:
    psql(url, f"DELETE FROM {SCHEMA}.relays")
    psql(url, f"UPDATE {SCHEMA}.relay_lanes SET owner = NULL, expires_at = NULL")


# --- Kafka ----------------------------------------------------------------------------------


def create_topics(bootstrap: str, names: list[str], log_append: set[str]) -> None:
    from kafka import KafkaAdminClient  # noqa: PLC0415
    from kafka.admin import NewTopic  # noqa: PLC0415

    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=30_000)
    try:
        admin.create_topics(
            [
                NewTopic(
                    name,
                    PARTITIONS,
                    1,
                    topic_configs={"message.timestamp.type": "LogAppendTime"}
                    if name in log_append
                    else {},
                )
                for name in names
            ]
        )
    finally:
        admin.close()


def delete_topics(bootstrap: str, names: list[str]) -> None:
    from kafka import KafkaAdminClient  # noqa: PLC0415

    with contextlib.suppress(Exception):
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
        try:
            admin.delete_topics(names)
        finally:
            admin.close()


def make_publisher(bootstrap: str, **overrides: Any) -> Any:
    """The relay's own Publisher: the producer gets exactly the relay's settings."""
    from relay.publisher import Publisher  # noqa: PLC0415
    from relay.settings import RelaySettings  # noqa: PLC0415

    settings = RelaySettings(
        kafka_bootstrap=bootstrap, relay_id=f"relaybench-raw-{os.getpid()}", **overrides
    )
    return Publisher(settings)


# --- the relay process --------------------------------------------------------------------


@dataclass
class RelayRun:
    label: str
    rows: int
    from_start_s: float = math.nan
    first_to_last_s: float = math.nan
    batches: int = 0
    first_batch: int = 0
    peak_rss_mb: float = math.nan
    relay_cores: float = math.nan  # the relay's CPU seconds per second of the drain
    machine_busy: float = math.nan  # fraction of all CPUs busy meanwhile (anyone)
    # (seconds from the relay's spawn, rows) per published_at: the suite's throughput plot
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.rows / self.from_start_s

    @property
    def steady_rate(self) -> float:
        if self.batches < 2 or self.first_to_last_s <= 0:
            return math.nan
        return (self.rows - self.first_batch) / self.first_to_last_s


@dataclass
class Ctx:
    url: str  # libpq URL of the benchmark's database
    bootstrap: str
    prefix: str
    logs: Path
    quick: bool
    relays: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def engine_url(self) -> str:
        return sqlalchemy_url(self.url)


class Relay:
    """``python -m relay`` as a child process, configured through its environment only."""

    def __init__(self, ctx: Ctx, name: str, *, deaf: bool = False, **settings: Any) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
        env |= {
            "OUTBOXKIT_RELAY_DATABASE_URL": ctx.url,
            "OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP": ctx.bootstrap,
            "OUTBOXKIT_RELAY_RELAY_ID": f"relaybench-{name}-{uuid.uuid4().hex[:6]}",
            "OUTBOXKIT_RELAY_HTTP_PORT": "0",
            "OUTBOXKIT_RELAY_LOG_LEVEL": "INFO",
        }
        for key, value in settings.items():
            env[f"OUTBOXKIT_RELAY_{key.upper()}"] = str(value)
        if deaf:
            # The relay LISTENs on OutboxSettings.notify_channel; emits notify the default
            # channel. A relay listening elsewhere is woken by its fallback poll only.
            env["OUTBOXKIT_NOTIFY_CHANNEL"] = DEAF_CHANNEL
        self.log_path = ctx.logs / f"relay-{name}.log"
        self._log = self.log_path.open("wb")
        self.started = time.monotonic()
        self.started_wall = time.time()  # to place published_at (database clock, same host)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay"],
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        ctx.relays.append(self.proc)
        self._ctx = ctx

    def status(self, field_name: str) -> float:
        """A /proc/<pid>/status size in MB (VmHWM: peak RSS so far)."""
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024
        return math.nan

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the relay exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-3000:]
        return ""

    def stop(self) -> None:
        """SIGTERM (graceful: it hands back its lanes), SIGKILL after 40 s; our child only."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        with contextlib.suppress(ValueError):
            self._ctx.relays.remove(self.proc)


def wait_drained(ctx: Ctx, relay: Relay, timeout_s: float) -> float:
    """Seconds from the relay's spawn until no row is pending (checked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(ctx.url, autocommit=True) as conn:
        while pending_exists(conn):
            relay.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not drain in {timeout_s:.0f} s:\n{relay.tail()}")
            time.sleep(POLL_S)
    return time.monotonic() - relay.started


def drain(ctx: Ctx, label: str, rows: int, **settings: Any) -> RelayRun:
    """Start one relay on the filled outbox, time it until everything is published."""
    run = RelayRun(label, rows)
    ticks = cpu_ticks()
    relay = Relay(ctx, label, **settings)
    try:
        run.from_start_s = wait_drained(ctx, relay, timeout_s=max(120.0, rows / 500))
        run.peak_rss_mb = relay.status("VmHWM")
        run.relay_cores = process_cpu_s(relay.proc.pid) / run.from_start_s
        run.machine_busy = busy_since(ticks)
    finally:
        relay.stop()
    stats = psql(
        ctx.url,
        f"""
        WITH b AS (SELECT published_at, count(*) AS n FROM {SCHEMA}.outbox_messages
                   WHERE status = 'published' GROUP BY published_at)
        SELECT count(*), extract(epoch FROM max(published_at) - min(published_at)),
               (SELECT n FROM b ORDER BY published_at LIMIT 1),
               (SELECT count(*) FROM {SCHEMA}.outbox_messages WHERE status <> 'published')
        FROM b
        """,
    )[0]
    run.batches, run.first_to_last_s, run.first_batch, left = (
        int(stats[0]),
        float(stats[1] or 0),
        int(stats[2] or 0),
        int(stats[3]),
    )
    if left:
        raise RuntimeError(f"{left} rows are not published after the relay drained ({label})")
    rows_at = psql(
        ctx.url,
        f"SELECT extract(epoch FROM published_at), count(*) FROM {SCHEMA}.outbox_messages "
        "GROUP BY published_at ORDER BY published_at",
    )
    run.timeline = [(float(at) - relay.started_wall, int(n)) for at, n in rows_at]
    return run


# --- filling the outbox ---------------------------------------------------------------------


def _emit_worker(engine_url: str, topic: str, worker: int, workers: int, n: int) -> int:
    """Every *workers*-th message from *worker* on, 1,000 per transaction.

    Workers get disjoint keys (KEYS is a multiple of *workers*): emit holds each key's
    advisory lock until commit, so overlapping keys in big transactions would deadlock.
    """
    from outbox.emit import emit  # noqa: PLC0415
    from outbox.envelope import Envelope  # noqa: PLC0415

    settings = OutboxSettings(schema_name=SCHEMA, lanes=LANES)
    engine = create_engine(engine_url, pool_size=1)
    mine = range(worker, n, workers)
    try:
        for low in range(0, len(mine), 1000):
            with engine.begin() as conn:
                for i in mine[low : low + 1000]:
                    envelope = Envelope(
                        topic=topic, type="bench.msg", key=key_for(i), payload=payload_for(i)
                    )
                    emit(conn, envelope, settings=settings)
    finally:
        engine.dispose()
    return len(mine)


def fill_template(ctx: Ctx, topic: str, n: int) -> float:
    """Emit N rows (1,000 per transaction, two processes), keep them as the template."""
    psql(ctx.url, f"TRUNCATE {SCHEMA}.outbox_messages")
    started = time.monotonic()
    workers = 2
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.starmap(_emit_worker, [(ctx.engine_url, topic, w, workers, n) for w in range(workers)])
    took = time.monotonic() - started
    psql(ctx.url, "DROP TABLE IF EXISTS relaybench_template")
    psql(
        ctx.url,
        f"CREATE TABLE relaybench_template AS SELECT * FROM {SCHEMA}.outbox_messages ORDER BY id",
    )
    return took


def refill_from_template(ctx: Ctx) -> None:
    """The template's rows, as emit wrote them, with fresh message ids, in emit order."""
    reset_relays(ctx.url)
    psql(ctx.url, f"TRUNCATE {SCHEMA}.outbox_messages")
    psql(
        ctx.url,
        f"""
        INSERT INTO {SCHEMA}.outbox_messages
            (message_id, topic, key, lane, message_type, payload, headers, run_id)
        SELECT gen_random_uuid(), topic, key, lane, message_type, payload, headers, run_id
        FROM relaybench_template ORDER BY id
        """,
    )
    settle(ctx.url)


def fill_generated(ctx: Ctx, topic: str, n: int) -> float:
    """N pending rows straight from generate_series (emit is far too slow for 1M)."""
    reset_relays(ctx.url)
    psql(ctx.url, f"TRUNCATE {SCHEMA}.outbox_messages")
    started = time.monotonic()
    psql(
        ctx.url,
        f"""
        INSERT INTO {SCHEMA}.outbox_messages
            (message_id, topic, key, lane, message_type, payload, headers, status)
        SELECT g.mid, %(topic)s, convert_to('key-' || lpad((g.i %% {KEYS})::text, 4, '0'), 'UTF8'),
               g.i %% {LANES}, 'bench.msg',
               convert_to('{{"seq":' || g.i || ',"data":"' || repeat(md5(g.i::text), 6)
                          || substr(md5(g.i::text || 'x'), 1, 18) || '"}}', 'UTF8'),
               jsonb_build_object('message-id', g.mid::text, 'message-type', 'bench.msg',
                                  'created-at', now()::text),
               'pending'
        FROM (SELECT i, gen_random_uuid() AS mid FROM generate_series(1, %(n)s) AS i) AS g
        """,
        {"topic": topic, "n": n},
    )
    took = time.monotonic() - started
    settle(ctx.url)
    return took


# --- (a) the producer alone -----------------------------------------------------------------


def load_template_messages(ctx: Ctx) -> list[tuple[str, bytes | None, bytes, list[Any]]]:
    """What the relay will send for the template rows: topic, key, value, headers."""
    from relay.claims import OutboxRow  # noqa: PLC0415
    from relay.publisher import kafka_headers  # noqa: PLC0415

    out = []
    with psycopg.connect(ctx.url) as conn:
        for r in conn.execute(
            "SELECT id, message_id, topic, key, message_type, payload, headers, created_at, "
            "lane, attempts FROM relaybench_template ORDER BY id"
        ):
            row = OutboxRow(
                r[0], r[1], r[2], bytes(r[3]), r[4], bytes(r[5]), dict(r[6]), r[7], r[8], r[9]
            )
            out.append((row.topic, row.key, row.payload, kafka_headers(row)))
    return out


def raw_ceiling(
    ctx: Ctx, messages: list[tuple[str, bytes | None, bytes, list[Any]]]
) -> tuple[float, float, float]:
    """Seconds for one relay-configured producer to send every message and flush, with the
    CPU cores this process used and the fraction of the machine busy meanwhile.

    The clock starts before the producer is built (it connects and fetches the topic's
    metadata inside the timing, as the relay must), headers are prepared beforehand.
    """
    ticks, cpu = cpu_ticks(), time.process_time()
    started = time.monotonic()
    publisher = make_publisher(ctx.bootstrap)
    producer = publisher.producer
    try:
        for topic, key, value, headers in messages:
            producer.send(topic, value=value, key=key, headers=headers)
        producer.flush()
        took = time.monotonic() - started
        cores, busy = (time.process_time() - cpu) / took, busy_since(ticks)
    finally:
        publisher.close(timeout_s=10)
    return took, cores, busy


# --- (c) latency ------------------------------------------------------------------------------


def _latency_writer(  # noqa: PLR0917 - a multiprocessing target
    engine_url: str, topic: str, rate: float, seconds: float, index: int, go: Any, out: Any
) -> None:
    """Paced single-message transactions; puts [(message id, wall clock after COMMIT)]."""
    from outbox.emit import emit  # noqa: PLC0415
    from outbox.envelope import Envelope  # noqa: PLC0415

    settings = OutboxSettings(schema_name=SCHEMA, lanes=LANES)
    engine = create_engine(engine_url, pool_size=1)
    with engine.connect():
        pass  # connected before the clock starts
    done: list[tuple[str, float]] = []
    total = int(rate * seconds)
    go.wait()  # every writer imported and connected: start together
    cpu0 = time.process_time()
    t0 = time.monotonic() + index / (rate * (go.parties - 1))  # interleaved, not in step
    try:
        for i in range(total):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            seq = index * 10_000_000 + i
            envelope = Envelope(
                topic=topic, type="bench.msg", key=key_for(seq), payload=payload_for(seq)
            )
            with engine.begin() as conn:
                mid = emit(conn, envelope, settings=settings)
            done.append((str(mid), time.time()))
    finally:
        engine.dispose()
        out.put((done, time.process_time() - cpu0))


def run_writers(
    ctx: Ctx, topic: str, rate: float, seconds: float, writers: int
) -> tuple[float, list[tuple[str, float]], float]:
    """Start time (wall clock), every writer's commits, and the writers' CPU seconds."""
    mpc = mp.get_context("spawn")
    go = mpc.Barrier(writers + 1)
    out = mpc.Queue()
    procs = [
        mpc.Process(
            target=_latency_writer,
            args=(ctx.engine_url, topic, rate / writers, seconds, w, go, out),
        )
        for w in range(writers)
    ]
    for proc in procs:
        proc.start()
    try:
        go.wait(timeout=120)
        start_at = time.time()
        parts = [out.get(timeout=seconds * 4 + 120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    committed = [item for done, _ in parts for item in done]
    return start_at, committed, sum(cpu for _, cpu in parts)


def warm_up(ctx: Ctx, relay: Relay, topic: str) -> None:
    """One message through the relay: producer connected, topic known, relay idle again."""
    from outbox.emit import emit  # noqa: PLC0415
    from outbox.envelope import Envelope  # noqa: PLC0415

    engine = create_engine(ctx.engine_url, pool_size=1)
    try:
        with engine.begin() as conn:
            emit(
                conn,
                Envelope(topic=topic, type="bench.warmup", key="warm", payload={}),
                settings=OutboxSettings(schema_name=SCHEMA, lanes=LANES),
            )
    finally:
        engine.dispose()
    wait_drained(ctx, relay, timeout_s=120)
    time.sleep(1.5)  # let it find the outbox empty and declare itself idle


def kafka_append_times(ctx: Ctx, topic: str, wanted: set[str]) -> dict[str, float]:
    """message-id header → broker LogAppendTime (s) for every record of *topic*."""
    from kafka import KafkaConsumer  # noqa: PLC0415

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=ctx.bootstrap.split(","),
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=5000,
    )
    found: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 120
        for record in consumer:
            if record.timestamp_type != 1:
                raise RuntimeError(f"topic {topic} does not stamp LogAppendTime")
            headers = dict(record.headers or [])
            mid = headers.get("message-id", b"").decode()
            if mid in wanted:
                found[mid] = record.timestamp / 1000
            if len(found) == len(wanted) or time.monotonic() > deadline:
                break
    finally:
        consumer.close()
    return found


@dataclass
class Latency:
    label: str
    offered: float = math.nan
    achieved: float = math.nan
    kafka_ms: list[float] = field(default_factory=list)
    db_ms: list[float] = field(default_factory=list)
    missing: int = 0
    relay_cores: float = math.nan
    writer_cores: float = math.nan
    machine_busy: float = math.nan


def latency(
    ctx: Ctx, label: str, *, deaf: bool, rate: float, seconds: float, writers: int
) -> Latency:
    """Writers at *rate* against one relay, NOTIFY-woken or (*deaf*) polling only."""
    topic = f"{ctx.prefix}.lat-{label}"
    reset_relays(ctx.url)
    psql(ctx.url, f"TRUNCATE {SCHEMA}.outbox_messages")
    result = Latency(label, offered=rate)
    relay = Relay(ctx, f"lat-{label}", deaf=deaf)
    try:
        warm_up(ctx, relay, topic)
        psql(ctx.url, "CHECKPOINT")  # no checkpoint debt from earlier phases in the timing
        ticks, relay_cpu = cpu_ticks(), process_cpu_s(relay.proc.pid)
        start_at, committed, writer_cpu = run_writers(ctx, topic, rate, seconds, writers)
        last = max(t for _, t in committed)
        result.machine_busy = busy_since(ticks)
        result.relay_cores = (process_cpu_s(relay.proc.pid) - relay_cpu) / (last - start_at)
        result.writer_cores = writer_cpu / (last - start_at)
        result.achieved = len(committed) / (last - start_at)
        wait_drained(ctx, relay, timeout_s=120)
        relay.check_alive()
    finally:
        relay.stop()
    # The first second is the relay and the writers settling: not steady state.
    steady = {mid: t for mid, t in committed if t >= start_at + 1.0}
    appended = kafka_append_times(ctx, topic, set(steady))
    result.missing = len(steady) - len(appended)
    result.kafka_ms = [(appended[m] - t) * 1000 for m, t in steady.items() if m in appended]
    rows = psql(
        ctx.url,
        f"SELECT message_id::text, extract(epoch FROM published_at - created_at) * 1000 "
        f"FROM {SCHEMA}.outbox_messages WHERE topic = %s AND status = 'published'",
        [topic],
    )
    result.db_ms = [float(ms) for mid, ms in rows if mid in steady]
    return result


# --- (d) claim cost ---------------------------------------------------------------------------


def claim_times(ctx: Ctx, rounds: int) -> float:
    """Median seconds of one 1,000-row claim by a relay that owns all 64 lanes."""
    from relay.claims import claim  # noqa: PLC0415
    from relay.lanes import LaneManager  # noqa: PLC0415

    reset_relays(ctx.url)
    engine = create_engine(ctx.engine_url, pool_size=2)
    lanes = LaneManager(
        engine,
        schema=SCHEMA,
        relay_id="relaybench-claim",
        lanes=LANES,
        lease_seconds=600,
        host=socket.gethostname(),
        pid=os.getpid(),
    )
    try:
        owned = lanes.heartbeat().tokens
        if len(owned) != LANES:
            raise RuntimeError(f"the claim benchmark owns {len(owned)} lanes, not {LANES}")
        times = []
        sizes = set()
        for i in range(rounds + 5):
            started = time.perf_counter()
            with engine.begin() as conn:
                rows = claim(
                    conn, SCHEMA, relay_id="relaybench-claim", lanes=owned, limit=1000, rotate=i
                )
            took = time.perf_counter() - started
            sizes.add(len(rows))
            if i >= 5:  # the first ones warm caches and psycopg's prepared statement
                times.append(took)
        if sizes != {1000}:
            raise RuntimeError(f"claims returned {sorted(sizes)} rows, not always 1000")
        return statistics.median(times)
    finally:
        with contextlib.suppress(Exception):
            lanes.leave()
        engine.dispose()


# --- report -----------------------------------------------------------------------------------


def machine_info(admin_url: str, bootstrap: str) -> dict[str, Any]:
    import kafka  # noqa: PLC0415

    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = math.nan
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_gb = int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024
    server = psql(admin_url, "SHOW server_version")[0][0]
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gb": round(mem_gb, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgres": server,
        "kafka_python": kafka.__version__,
        "kafka_bootstrap": bootstrap,
        "loadavg_start": os.getloadavg(),
    }


# --- the run ------------------------------------------------------------------------------


def services(args: argparse.Namespace) -> contextlib.AbstractContextManager[tuple[str, str]]:
    return throwaway.services(args, "relaybench", log)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--database-url", help="an existing PostgreSQL server (admin URL)")
    p.add_argument("--kafka-bootstrap", help="an existing Kafka broker host:port")
    p.add_argument("--quick", action="store_true", help="small N and short phases: a smoke run")
    p.add_argument("--n", type=int, help="backlog size of (a)/(b) (default 100,000; quick 20,000)")
    p.add_argument("--rounds", type=int, help="rounds of (a)+(b) (default 3; quick 1)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--state-dir", help="where the throwaway services live (kept if given)")
    p.add_argument("--rate", type=float, default=1000.0, help="offered load of (c), msgs/s")
    p.add_argument("--writers", type=int, default=4, help="writer processes of (c)")
    p.add_argument("--latency-seconds", type=float, help="length of (c) (default 15; quick 6)")
    p.add_argument(
        "--low-seconds", type=float, help="length of (c3) (default 10; quick 5; 0 skips it)"
    )
    p.add_argument(
        "--claim-backlog", type=int, help="large backlog of (d) (default 1,000,000; quick 100,000)"
    )
    p.add_argument(
        "--rss-backlog", type=int, help="large backlog of (e) (default 200,000; quick 100,000)"
    )
    p.add_argument(
        "--allow-not-durable",
        action="store_true",
        help="leave the server's durability as it is (a smoke run on a test server; figures "
        "then mean nothing)",
    )
    p.add_argument(
        "--samples", help="write the raw latencies and the drains' publish timelines here (JSON)"
    )
    return p.parse_args(argv)


def plan_of(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    return {
        "quick": quick,
        "durable": not args.allow_not_durable,
        "n": args.n or (20_000 if quick else 100_000),
        "rounds": args.rounds or (1 if quick else 3),
        "lat_s": args.latency_seconds or (6.0 if quick else 15.0),
        "rate": args.rate,
        "writers": args.writers,
        "low_rate": 20.0,
        # 0 skips (c3): the suite's smoke run has no use for a phase that measures nothing.
        "low_s": (5.0 if quick else 10.0) if args.low_seconds is None else args.low_seconds,
        "claims": 20 if quick else 30,
        "big_claim": args.claim_backlog or (100_000 if quick else 1_000_000),
        "big_rss": args.rss_backlog or (100_000 if quick else 200_000),
        "variants": [("batch 2000", {"batch_size": 2000})]
        if quick
        else [
            ("batch 500", {"batch_size": 500}),
            ("batch 2000", {"batch_size": 2000}),
            ("batch 5000", {"batch_size": 5000}),
            ("batch 1000, linger 0", {"batch_size": 1000, "linger_ms": 0}),
            ("batch 1000, linger 20", {"batch_size": 1000, "linger_ms": 20}),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    plan = plan_of(args)
    started = datetime.now(UTC)
    t_run = time.monotonic()
    cached_jars = Path("/tmp/kjars/libs")  # noqa: S108 - broker jars other runs fetched
    if cached_jars.is_dir():
        os.environ.setdefault("OUTBOXKIT_KAFKA_LIBS", str(cached_jars))

    with services(args) as (admin_url, bootstrap):
        machine = machine_info(admin_url, bootstrap)
        durability, restore = (
            ("not checked (--allow-not-durable)", lambda: None)
            if args.allow_not_durable
            else make_durable(admin_url)
        )
        samples: dict[str, Any] = {}
        try:
            figures = in_own_database(admin_url, bootstrap, plan, durability, samples)
        finally:
            restore()
            after = show(admin_url)
            print(f"durability restored: SHOW {', '.join(f'{k}={v}' for k, v in after.items())}")

    machine["loadavg_end"] = os.getloadavg()
    print(
        f"\nmachine: {machine['cpus']} cpus ({machine['cpu_model']}), load avg at start "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_end'])}; PostgreSQL "
        f"{machine['postgres']}, kafka-python {machine['kafka_python']}; "
        f"run took {time.monotonic() - t_run:.0f} s\n"
    )
    print_table(figures)
    if args.json:
        document = {
            "machine": machine,
            "started": started.isoformat(),
            "durability": durability,
            "figures": [f.as_json() for f in figures],
        }
        Path(args.json).write_text(json.dumps(document, indent=2))
        print(f"\nfigures written to {args.json}")
    if args.samples:
        Path(args.samples).write_text(json.dumps(samples))
        print(f"samples written to {args.samples}")
    return 0


def in_own_database(
    admin_url: str,
    bootstrap: str,
    plan: dict[str, Any],
    durability: str,
    samples: dict[str, Any] | None = None,
) -> list[Figure]:
    """Run every phase in a database and topics of its own, dropped at the end."""
    db = f"relaybench_{uuid.uuid4().hex[:8]}"
    prefix = f"relaybench.{uuid.uuid4().hex[:8]}"
    logs = Path(f"/tmp/{db}-logs")  # noqa: S108
    logs.mkdir(parents=True, exist_ok=True)
    psql(admin_url, f'CREATE DATABASE "{db}"')
    ctx = Ctx(with_database(admin_url, db), bootstrap, prefix, logs, plan["quick"])
    topics = [f"{prefix}.tput", f"{prefix}.drain"] + [
        f"{prefix}.lat-{label}" for label in ("notify", "poll", "notify-low", "poll-low")
    ]
    try:
        shown = show(ctx.url)
        if shown["fsync"] != "on" and plan["durable"]:
            raise SystemExit(f"REFUSED: fsync is {shown['fsync']} in the benchmark database")
        print(f"durability: {durability}")
        print(
            f"setup: N={plan['n']:,}, rounds={plan['rounds']}, {LANES} lanes, {KEYS} keys, "
            f"{PARTITIONS} partitions, quick={plan['quick']}; relay logs in {logs}"
        )
        return run_all(ctx, plan, topics, samples)
    finally:
        for proc in list(ctx.relays):  # only relays this run started, should one be left
            with contextlib.suppress(Exception):
                proc.kill()
        with contextlib.suppress(Exception):
            psql(admin_url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        delete_topics(bootstrap, topics)


@dataclass
class Results:
    rounds: int = 0
    raw: list[float] = field(default_factory=list)
    raw_spent: list[Spent] = field(default_factory=list)
    relay_runs: list[RelayRun] = field(default_factory=list)
    variants: list[tuple[str, RelayRun]] = field(default_factory=list)
    lat: dict[str, Latency] = field(default_factory=dict)
    claim_small_s: float = math.nan
    claim_large_s: float = math.nan
    claim_large_rows: int = 0
    rss_small: RelayRun | None = None
    rss_large: RelayRun | None = None

    def kafka_ms(self, label: str) -> list[float]:
        """The latencies of phase ``label``; none when the phase was skipped."""
        lat = self.lat.get(label)
        return lat.kafka_ms if lat else []


def run_all(
    ctx: Ctx, plan: dict[str, Any], topics: list[str], samples: dict[str, Any] | None = None
) -> list[Figure]:
    from outbox.migrate import migrate  # noqa: PLC0415

    engine: Engine = create_engine(ctx.engine_url)
    try:
        migrate(engine)
    finally:
        engine.dispose()
    create_topics(ctx.bootstrap, topics, log_append={t for t in topics if ".lat-" in t})
    res = Results(rounds=plan["rounds"])
    phase_throughput(ctx, plan, topics[0], res)
    phase_latency(ctx, plan, res)
    phase_claims_and_memory(ctx, plan, topics[1], res)
    if samples is not None:
        samples.update(samples_of(res))
    return figures_of(res)


def samples_of(res: Results) -> dict[str, Any]:
    """The raw data behind the figures, for plots: commit-to-appended latencies (ms) per
    phase of (c), and every (b) round's publish timeline."""
    return {
        "latency_ms": {label: lat.kafka_ms for label, lat in res.lat.items()},
        "producer_alone_msgs_per_s": statistics.median(res.raw),
        "drains": [
            {
                "label": run.label,
                "rows": run.rows,
                "from_start_s": run.from_start_s,
                "timeline": run.timeline,
            }
            for run in res.relay_runs
        ],
    }


def phase_throughput(ctx: Ctx, plan: dict[str, Any], topic: str, res: Results) -> None:
    """(a) and (b), alternating round by round, then the variants of (b) once each."""
    n = plan["n"]
    log(f"emitting the {n:,}-row backlog (not timed)")
    took = fill_template(ctx, topic, n)
    print(
        f"\nfill: {n:,} rows by emit, 1,000 per transaction, 2 processes: {took:.1f} s "
        f"({n / took:,.0f} rows/s; not part of any figure). Every (b) round starts from a copy "
        "of these rows (fresh message ids), VACUUM ANALYZE and CHECKPOINT."
    )
    messages = load_template_messages(ctx)
    print(
        "\n(a) producer alone (relay.publisher.Publisher's KafkaProducer: acks=all, "
        "idempotence, linger 5 ms, batch 256 KiB, lz4, 5 in flight), timed from building "
        "the producer to the end of flush() / (b) one relay process draining the same rows, "
        "timed from spawn until nothing is pending"
    )
    for r in range(plan["rounds"]):
        log(f"round {r + 1}/{plan['rounds']}: (a) producer alone")
        took, cores, busy = raw_ceiling(ctx, messages)
        res.raw.append(n / took)
        res.raw_spent.append(Spent(n / took, cores, busy))
        print(
            f"  round {r + 1}: (a) {res.raw[-1]:,.0f} msgs/s ({took:.2f} s), producer "
            f"{cores:.2f} cores, machine {busy:.0%} busy"
        )
        log(f"round {r + 1}/{plan['rounds']}: (b) relay, batch 1000")
        refill_from_template(ctx)
        run = drain(ctx, f"tput-{r + 1}", n)
        res.relay_runs.append(run)
        print(
            f"  round {r + 1}: (b) {run.rate:,.0f} msgs/s from spawn ({run.from_start_s:.2f} s), "
            f"{run.steady_rate:,.0f} msgs/s first→last batch ({run.first_to_last_s:.2f} s, "
            f"{run.batches} batches), peak RSS {run.peak_rss_mb:.0f} MB, relay "
            f"{run.relay_cores:.2f} cores, machine {run.machine_busy:.0%} busy"
        )
    for label, settings in plan["variants"]:
        log(f"(b) variant {label}")
        refill_from_template(ctx)
        run = drain(ctx, "tput-" + label.replace(" ", "").replace(",", "-"), n, **settings)
        res.variants.append((label, run))
        print(
            f"  {label}: {run.rate:,.0f} msgs/s from spawn ({run.from_start_s:.2f} s), "
            f"{run.steady_rate:,.0f} first→last ({run.batches} batches), relay "
            f"{run.relay_cores:.2f} cores, machine {run.machine_busy:.0%} busy"
        )


def phase_latency(ctx: Ctx, plan: dict[str, Any], res: Results) -> None:
    rate, seconds, writers = plan["rate"], plan["lat_s"], plan["writers"]
    print(
        f"\n(c) latency: {writers} writer processes commit single-message transactions (emit, "
        f"unique message id) paced to {rate:,.0f}/s in total for {seconds:.0f} s; the first "
        "second is discarded. Per message: the broker's LogAppendTime of the record (topic "
        "created with message.timestamp.type=LogAppendTime, 1 ms resolution, read back with "
        "a consumer afterwards) minus the writer's wall clock right after COMMIT returned: "
        "commit-to-appended; the relay's ack follows within one request round trip. Same "
        "host clock for both. For comparison 'db' = published_at - created_at (database "
        "clock; created_at is the writer transaction's start, published_at the start of the "
        "relay's marking transaction). c1 'notify': the default relay. c2 'poll': the relay "
        f"process alone gets OUTBOXKIT_NOTIFY_CHANNEL={DEAF_CHANNEL}, so it LISTENs where "
        "nobody notifies (emits still pg_notify the default channel while the relay is "
        "idle) and only its fallback poll wakes it, poll_interval_seconds at its default "
        "of 1.0 s."
    )
    low = plan["low_rate"]
    print(
        f"  (c3, extra) the same at a low load, {low:.0f} msgs/s from 1 writer for "
        f"{plan['low_s']:.0f} s, where the relay is idle between messages and NOTIFY matters."
    )
    for label, deaf, r, sec, w in (
        ("notify", False, rate, seconds, writers),
        ("poll", True, rate, seconds, writers),
        ("notify-low", False, low, plan["low_s"], 1),
        ("poll-low", True, low, plan["low_s"], 1),
    ):
        if sec <= 0:
            continue
        log(f"(c) latency, {label}: {r:,.0f} msgs/s for {sec:.0f} s")
        lat = latency(ctx, label, deaf=deaf, rate=r, seconds=sec, writers=w)
        res.lat[label] = lat
        print(
            f"  {label}: offered {lat.offered:,.0f}/s, achieved {lat.achieved:,.0f}/s, "
            f"{len(lat.kafka_ms):,} messages measured ({lat.missing} not found in Kafka); "
            f"kafka p50 {pct(lat.kafka_ms, 50):.1f} p90 {pct(lat.kafka_ms, 90):.1f} "
            f"p99 {pct(lat.kafka_ms, 99):.1f} max {max(lat.kafka_ms, default=math.nan):.1f} ms; "
            f"db p50 {pct(lat.db_ms, 50):.1f} p99 {pct(lat.db_ms, 99):.1f} ms; CPU: relay "
            f"{lat.relay_cores:.2f} cores, writers {lat.writer_cores:.2f}, machine "
            f"{lat.machine_busy:.0%} busy (everyone's)"
        )


def phase_claims_and_memory(ctx: Ctx, plan: dict[str, Any], topic: str, res: Results) -> None:
    claims, big_claim, big_rss = plan["claims"], plan["big_claim"], plan["big_rss"]
    log("(d) 10k pending rows")
    fill_generated(ctx, topic, 10_000)
    res.claim_small_s = claim_times(ctx, claims)
    log("(e) draining 10k")
    res.rss_small = drain(ctx, "rss-10k", 10_000)
    log(f"(d) {big_claim:,} pending rows (generate_series, not timed)")
    took = fill_generated(ctx, topic, big_claim)
    res.claim_large_s = claim_times(ctx, claims)
    res.claim_large_rows = big_claim
    print(
        f"\n(d) claim of 1,000 rows (relay.claims.claim, all 64 lanes owned, lanes 0..63 "
        f"filled evenly by INSERT … generate_series, VACUUM ANALYZE), median of {claims} "
        f"after 5 warm-ups: {res.claim_small_s * 1000:.1f} ms with 10k pending, "
        f"{res.claim_large_s * 1000:.1f} ms with {big_claim:,} pending (fill {took:.0f} s)"
    )
    if big_rss != big_claim:
        log(f"(e) refilling {big_rss:,}")
        fill_generated(ctx, topic, big_rss)
    log(f"(e) draining {big_rss:,}")
    res.rss_large = drain(ctx, f"rss-{big_rss}", big_rss)
    print(
        f"(e) relay peak RSS (VmHWM at the end of the drain): {res.rss_small.peak_rss_mb:.1f} "
        f"MB draining 10k ({res.rss_small.rate:,.0f} msgs/s), "
        f"{res.rss_large.peak_rss_mb:.1f} MB draining {big_rss:,} "
        f"({res.rss_large.rate:,.0f} msgs/s)"
    )


def figures_of(res: Results) -> list[Figure]:
    assert res.rss_small is not None
    assert res.rss_large is not None
    ceiling = statistics.median(res.raw)
    b_rate = statistics.median(r.rate for r in res.relay_runs)
    b_steady = statistics.median(r.steady_rate for r in res.relay_runs)
    ratio = b_rate / ceiling
    steady_ratio = b_steady / ceiling
    claim_ratio = res.claim_large_s / res.claim_small_s
    small, large = res.rss_small.peak_rss_mb, res.rss_large.peak_rss_mb
    peak = max(small, large)
    flat = large - small <= 20
    notify, poll = res.lat["notify"], res.lat["poll"]
    n_p50, n_p99 = pct(notify.kafka_ms, 50), pct(notify.kafka_ms, 99)
    figures = [
        Figure("kafka.producer_alone_msgs_per_s", ceiling, "msgs/s", note="median of rounds"),
        Figure(
            "relay.throughput_msgs_per_s",
            b_rate,
            "msgs/s",
            ceiling,
            ratio,
            note="from process spawn until nothing pending, batch 1000; median of rounds",
        ),
        Figure("relay.throughput_ratio", ratio, "ratio", ceiling, ratio, "≥ 0.8", ratio >= 0.8),
        Figure(
            "relay.throughput_msgs_per_s_steady",
            b_steady,
            "msgs/s",
            ceiling,
            steady_ratio,
            note="first to last published batch (no start-up)",
        ),
        Figure(
            "relay.throughput_ratio_steady",
            steady_ratio,
            "ratio",
            ceiling,
            steady_ratio,
            "≥ 0.8",
            steady_ratio >= 0.8,
        ),
    ]
    for label, run in res.variants:
        name = "relay.throughput_msgs_per_s_" + label.replace(" ", "").replace(",", "_")
        figures.append(Figure(name, run.rate, "msgs/s", ceiling, run.rate / ceiling))
    cpus = os.cpu_count() or 1
    figures += cpu_budget("kafka.producer_alone", res.raw_spent, ceiling, cpus)
    figures += cpu_budget(
        "relay",
        [Spent(r.rate, r.relay_cores, r.machine_busy) for r in res.relay_runs],
        ceiling,
        cpus,
    )
    figures += [
        Figure("relay.latency_p50_ms", n_p50, "ms", goal="≤ 10", met=n_p50 <= 10),
        Figure("relay.latency_p99_ms", n_p99, "ms", goal="≤ 50", met=n_p99 <= 50),
        Figure("relay.latency_p50_ms_polling", pct(poll.kafka_ms, 50), "ms"),
        Figure("relay.latency_p99_ms_polling", pct(poll.kafka_ms, 99), "ms"),
        Figure("relay.latency_p50_ms_low_rate", pct(res.kafka_ms("notify-low"), 50), "ms"),
        Figure("relay.latency_p99_ms_low_rate", pct(res.kafka_ms("notify-low"), 99), "ms"),
        Figure(
            "relay.latency_p50_ms_low_rate_polling", pct(res.kafka_ms("poll-low"), 50), "ms"
        ),
        Figure(
            "relay.latency_p99_ms_low_rate_polling", pct(res.kafka_ms("poll-low"), 99), "ms"
        ),
        Figure("relay.latency_p50_ms_db", pct(notify.db_ms, 50), "ms"),
        Figure("relay.latency_p99_ms_db", pct(notify.db_ms, 99), "ms"),
        Figure("relay.latency_load_msgs_per_s", notify.achieved, "msgs/s", note="achieved"),
        Figure("relay.claim_ms_10k", res.claim_small_s * 1000, "ms"),
        Figure(f"relay.claim_ms_{res.claim_large_rows // 1000}k", res.claim_large_s * 1000, "ms"),
        Figure(
            "relay.claim_backlog_ratio",
            claim_ratio,
            "ratio",
            goal="≤ 1.5",
            met=claim_ratio <= 1.5,
            note=f"{res.claim_large_rows:,} vs 10,000 pending",
        ),
        Figure("relay.peak_rss_mb_10k", small, "MB"),
        Figure(f"relay.peak_rss_mb_{res.rss_large.rows // 1000}k", large, "MB"),
        Figure(
            "relay.peak_rss_mb",
            peak,
            "MB",
            goal="≤ 200, flat",
            met=peak <= 200 and flat,
            note="max VmHWM; flat = the large backlog's within 20 MB of the small one's",
        ),
    ]
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
