"""What the relay delivers, against what the Kafka producer alone can do (issue 4).

One run, one machine, one broker, durable PostgreSQL (fsync, synchronous_commit and
full_page_writes turned on with ALTER SYSTEM for the run, restored afterwards; the run is
refused if that does not take effect):

(a) ceiling: kafka-python's KafkaProducer alone — built by ``relay.publisher.Publisher``, so
    with exactly the relay's producer settings — sends the N rows of the backlog (same
    topic, keys, payload bytes and headers as the relay sends), then flushes;
(r) read ceiling: one Python process reads the same N rows with psycopg, keyset pages of
    1,000 by id; with (a) it gives the bound 1 / (1/(a) + 1/(r)) that (b) is held to;
(b) throughput: one ``python -m relay`` process drains a backlog of the same N rows
    (written by ``outbox.messages.emit.emit`` once, then copied per round, to a topic of its own per
    drain); timed from the spawn of the process until the topic's end offsets add up to N
    (polled every 50 ms; nothing reads PostgreSQL meanwhile), and from the first record's
    broker append time to the last (LogAppendTime topics; no start-up). Meanwhile: CPU of
    every PostgreSQL process of the cluster (/proc), and the rows the relay updated or
    deleted (pg_stat_user_tables). Rounds of (a), (r) and (b) alternate; medians are
    reported; other batch sizes and linger values run once each;
(c) latency at a steady offered load (single-message transactions from writer processes,
    paced), with NOTIFY (c1) and with the relay deaf to NOTIFY, polling only (c2); and the
    same at a low load (20 msgs/s), where the relay idles between messages; and (c4) at
    200 msgs/s: the relay's own CPU and latency under a light steady load;
(d) the relay's time per 1,000 rows at the head of a 10k vs a 1M-row backlog, from the
    broker append times of its records (start-up excluded, no relay internals called);
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
import importlib.util
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
from figures import (  # bench/figures.py (on sys.path)
    Figure,
    Spent,
    confluent_version,
    cpu_budget,
    print_table,
)
from sqlalchemy import Engine, create_engine

from outbox.db.dsn import sqlalchemy_url, with_database
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


def thread_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of each thread of one process, by thread name
    (librdkafka's rdk:*, the relay's relay-mark/relay-read/relay-listen, python: the main
    loop); threads of one name added up."""
    found: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = (task / "stat").read_text()
            name = text[text.index("(") + 1:text.rindex(")")]
            after_name = text.rsplit(")", 1)[1].split()
            spent = (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")
            found[name] = found.get(name, 0.0) + spent
    return found


def psql(url: str, statement: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else None


def settle(url: str) -> None:
    """After a fill: statistics, visibility map, and no checkpoint debt inside a timing."""
    psql(url, f"VACUUM ANALYZE {SCHEMA}.outbox_messages")
    psql(url, "CHECKPOINT")


def reset_relays(url: str) -> None:
    psql(url, f"DELETE FROM {SCHEMA}.relays")
    psql(url, f"UPDATE {SCHEMA}.relay_lanes SET owner = NULL, expires_at = NULL")


def has_relation(url: str, name: str) -> bool:
    """Whether ``outboxkit.<name>`` exists: the bench runs on the schema before and after
    issue 14 (status columns on outbox_messages, or the view message_status)."""
    return bool(psql(url, "SELECT to_regclass(%s) IS NOT NULL", [f"{SCHEMA}.{name}"])[0][0])


# --- what PostgreSQL spends: CPU of the cluster's processes, dead tuples -------------------


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces): field 3 on."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


@dataclass(frozen=True)
class PgCpuSnapshot:
    own: int  # the postmaster's utime + stime (ticks)
    reaped: int  # its cutime + cstime: every child that exited and was waited for
    children: dict[tuple[int, int], int]  # (pid, start time) → utime + stime, alive now
    others: frozenset[int]  # pids of other databases' backends (pg_stat_activity) now


class PgCpu:
    """CPU of every process of one PostgreSQL cluster on this host, from /proc.

    Children of the postmaster (backends, autovacuum launcher and workers, walwriter,
    checkpointer, bgwriter, ...) are read one by one; a child that exits meanwhile is
    counted through the postmaster's cutime/cstime, which grow by the whole CPU of each
    child it waits for, less what that child had already used at the first snapshot.
    Backends of other databases alive at either snapshot are left out (a shared server);
    ones that come and go between snapshots cannot be told apart and count.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.postmaster = 0
        self.database = ""
        self.why_not = ""
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute("SELECT pg_backend_pid(), current_database()").fetchone()
            assert row is not None
            backend, self.database = int(row[0]), str(row[1])
            status = Path(f"/proc/{backend}/status").read_text()
            self.postmaster = int(status.split("\nPPid:", 1)[1].split()[0])
            if b"postgres" not in Path(f"/proc/{self.postmaster}/cmdline").read_bytes():
                self.why_not = f"pid {self.postmaster} is not a postgres process"
        except (OSError, IndexError, ValueError, AssertionError) as exc:
            self.why_not = f"the server's processes are not visible here ({exc})"
        if self.why_not:
            self.postmaster = 0

    def snapshot(self) -> PgCpuSnapshot:
        rows = psql(
            self.url,
            "SELECT pid FROM pg_stat_activity WHERE datname IS NOT NULL AND datname <> %s",
            [self.database],
        )
        children = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                f = _stat_fields(stat.parent.name)
                if int(f[1]) == self.postmaster:  # field 4: PPid
                    children[(int(stat.parent.name), int(f[19]))] = int(f[11]) + int(f[12])
        own = _stat_fields(self.postmaster)
        return PgCpuSnapshot(
            int(own[11]) + int(own[12]),
            int(own[13]) + int(own[14]),
            children,
            frozenset(int(pid) for (pid,) in rows),
        )

    def seconds(self, before: PgCpuSnapshot, after: PgCpuSnapshot) -> float:
        """CPU seconds the cluster used between two snapshots (NaN if not visible)."""
        if not self.postmaster:
            return math.nan
        others = before.others | after.others
        ticks = after.own - before.own + after.reaped - before.reaped
        for key, used in after.children.items():
            if key[0] not in others:
                ticks += used - before.children.get(key, 0)
        for key, used in before.children.items():
            if key not in after.children:
                ticks -= used  # exited: its whole CPU is in cutime/cstime now
        return ticks / os.sysconf("SC_CLK_TCK")


# (n_tup_upd, n_tup_del, n_tup_hot_upd, n_dead_tup) per table of the schema
TableStats = dict[str, tuple[int, int, int, int]]


def table_stats(url: str) -> TableStats:
    """Cumulative row changes of the schema's tables. PostgreSQL 15 flushes a backend's
    statistics at transaction end at most once a second (and at exit): callers sleep
    1.5 s after the work before reading."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = conn.execute(
            "SELECT relname, n_tup_upd, n_tup_del, n_tup_hot_upd, n_dead_tup "
            "FROM pg_stat_user_tables WHERE schemaname = %s",
            [SCHEMA],
        ).fetchall()
    return {str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def stats_delta(before: TableStats, after: TableStats) -> TableStats:
    zero = (0, 0, 0, 0)
    return {
        name: tuple(a - b for a, b in zip(now, before.get(name, zero), strict=True))  # type: ignore[misc]
        for name, now in sorted(after.items())
    }


def dead_tuples(delta: TableStats) -> int:
    """Row versions the relay left dead: n_tup_upd + n_tup_del (each UPDATE or DELETE of a
    row leaves one; n_dead_tup is not used, autovacuum lowers it meanwhile)."""
    return sum(upd + dele for upd, dele, _hot, _dead in delta.values())


def stats_line(delta: TableStats) -> str:
    changed = {n: d for n, d in delta.items() if any(d)}
    return "; ".join(
        f"{n} upd {u:,} (hot {h:,}) del {d:,} n_dead_tup {dead:+,}"
        for n, (u, d, h, dead) in changed.items()
    ) or "no row updated or deleted"


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


class TopicWatch:
    """How many records one topic holds: the sum of its partitions' end offsets.

    "Drained" is read here, from Kafka, not from the outbox table: polling PostgreSQL
    every 50 ms would add its CPU to what the bench measures, and the outbox's columns are
    the relay's business (issue 14 removes them).
    """

    def __init__(self, bootstrap: str, topic: str) -> None:
        from kafka import KafkaConsumer, TopicPartition  # noqa: PLC0415

        self.topic = topic
        self.consumer = KafkaConsumer(
            bootstrap_servers=bootstrap.split(","), group_id=None, enable_auto_commit=False
        )
        deadline = time.monotonic() + 30  # a topic created a moment ago may be unknown yet
        while not (partitions := self.consumer.partitions_for_topic(topic) or set()):
            if time.monotonic() > deadline:
                self.consumer.close()
                raise RuntimeError(f"topic {topic} has no partitions: create it first")
            time.sleep(0.2)
        self.partitions = [TopicPartition(topic, p) for p in sorted(partitions)]
        self.start = self.count()

    def count(self) -> int:
        return int(sum(self.consumer.end_offsets(self.partitions).values()))

    def added(self) -> int:
        """Records appended since the watch began."""
        return self.count() - self.start

    def close(self) -> None:
        self.consumer.close()


def append_times(bootstrap: str, topic: str) -> list[tuple[float, str]]:
    """(broker LogAppendTime in s, message-id header) of every record of *topic*, read
    from the beginning to the end offsets as they are now."""
    from kafka import KafkaConsumer, TopicPartition  # noqa: PLC0415

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap.split(","),
        group_id=None,
        enable_auto_commit=False,
        max_poll_records=5000,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    out: list[tuple[float, str]] = []
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        left = {tp for tp in parts if ends[tp] > 0}
        deadline = time.monotonic() + 300
        while left:
            if time.monotonic() > deadline:
                raise RuntimeError(f"reading {topic} back took over 300 s")
            for tp, records in consumer.poll(timeout_ms=1000).items():
                for record in records:
                    if record.timestamp_type != 1:
                        raise RuntimeError(f"topic {topic} does not stamp LogAppendTime")
                    mid = dict(record.headers or []).get("message-id", b"").decode()
                    out.append((record.timestamp / 1000, mid))
                if consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
                    consumer.pause(tp)
    finally:
        consumer.close()
    return out


def make_publisher(bootstrap: str, **overrides: Any) -> Any:
    """The relay's own Publisher: the producer gets exactly the relay's settings (and its
    Kafka client: ``kafka_client=...``)."""
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
    appends: int = 0  # distinct LogAppendTime milliseconds among the records
    first_append: int = 0  # records stamped with the first of them
    peak_rss_mb: float = math.nan
    relay_cores: float = math.nan  # the relay's CPU seconds per second of the drain
    machine_busy: float = math.nan  # fraction of all CPUs busy meanwhile (anyone)
    pg_cpu_s: float = math.nan  # CPU of the cluster's processes from spawn to drained
    table_delta: TableStats = field(default_factory=dict)  # spawn to relay stopped
    # (seconds from the relay's spawn, records) per broker append time: the throughput plot
    timeline: list[tuple[float, int]] = field(default_factory=list)
    appended_at: list[float] = field(default_factory=list)  # every record's, sorted

    @property
    def rate(self) -> float:
        return self.rows / self.from_start_s

    @property
    def steady_rate(self) -> float:
        if self.appends < 2 or self.first_to_last_s <= 0:
            return math.nan
        return (self.rows - self.first_append) / self.first_to_last_s

    @property
    def pg_cpu_us_per_msg(self) -> float:
        return self.pg_cpu_s * 1e6 / self.rows

    @property
    def dead_per_msg(self) -> float:
        return dead_tuples(self.table_delta) / self.rows if self.table_delta else math.nan


@dataclass
class Ctx:
    url: str  # libpq URL of the benchmark's database
    bootstrap: str
    prefix: str
    logs: Path
    quick: bool
    relays: list[subprocess.Popen[bytes]] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)  # created here, deleted at the end
    pg: PgCpu | None = None
    client: str = "kafka-python"  # the relay's client unless a phase names another (--clients)

    @property
    def engine_url(self) -> str:
        return sqlalchemy_url(self.url)

    def topic(self, name: str) -> str:
        """A new topic of its own (LogAppendTime, PARTITIONS partitions) for one phase."""
        topic = f"{self.prefix}.{name}"
        create_topics(self.bootstrap, [topic], log_append={topic})
        self.topics.append(topic)
        return topic


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
            # Retention off: deleting published rows is not what a drain measures, and its
            # dead tuples would land in relay.dead_tuples_per_msg.
            "OUTBOXKIT_RELAY_PUBLISHED_RETENTION_SECONDS": "0",
        }
        for key, value in {"kafka_client": ctx.client, **settings}.items():
            env[f"OUTBOXKIT_RELAY_{key.upper()}"] = str(value)
        if deaf:
            # The relay LISTENs on OutboxSettings.notify_channel; emits notify the default
            # channel. A relay listening elsewhere is woken by its fallback poll only.
            env["OUTBOXKIT_NOTIFY_CHANNEL"] = DEAF_CHANNEL
        self.log_path = ctx.logs / f"relay-{name}.log"
        self._log = self.log_path.open("wb")
        self.started = time.monotonic()
        self.started_wall = time.time()  # to place the broker's append times (same host)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay"],
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        ctx.relays.append(self.proc)
        self._ctx = ctx
        self._profile(ctx, name)

    def _profile(self, ctx: Ctx, name: str) -> None:
        """With RELAYBENCH_PROFILE set, py-spy samples the relay (every thread, on-CPU only; with
        RELAYBENCH_PROFILE=gil, only the thread holding the GIL; RELAYBENCH_RATE samples a second,
        250 unless set)
        until it exits, into <logs>/relay-<name>.pyspy (collapsed stacks: flamegraph.pl or
        speedscope read them). Profiling costs the relay some speed: not for figures."""
        if not os.environ.get("RELAYBENCH_PROFILE"):
            return
        spy = Path(sys.executable).with_name("py-spy")
        out = ctx.logs / f"relay-{name}.pyspy"
        subprocess.Popen(  # our own child: it ends with the relay
            [str(spy), "record", "--pid", str(self.proc.pid),
             "--rate", os.environ.get("RELAYBENCH_RATE", "250"), "--threads",
             "--nonblocking", "--format", "raw", "--output", str(out),
             # "gil": only the thread holding the GIL, i.e. Python's own CPU (py-spy's idle
             # detection counts some waits in C as busy).
             *(["--gil"] if os.environ["RELAYBENCH_PROFILE"] == "gil" else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"  profiling relay {name} into {out}")

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


def wait_drained(relay: Relay, watch: TopicWatch, expected: int, timeout_s: float) -> float:
    """Seconds from the relay's spawn until *expected* records were appended to the
    watched topic since the watch began (end offsets checked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while (got := watch.added()) < expected:
        relay.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the relay published {got:,} of {expected:,} in {timeout_s:.0f} s:\n"
                f"{relay.tail()}"
            )
        time.sleep(POLL_S)
    return time.monotonic() - relay.started


def drain(
    ctx: Ctx,
    label: str,
    topic: str,
    rows: int,
    *,
    timeline: bool = True,
    stop_after: int | None = None,
    **settings: Any,
) -> RelayRun:
    """Start one relay on the filled outbox (every row for *topic*, a topic of its own)
    and time it until *rows* records are in Kafka (*stop_after*: stop it after that many).

    Also measured from spawn to drained: the relay's CPU and the whole machine's, the CPU
    of every PostgreSQL process; from spawn to the relay stopped (its backends' statistics
    are flushed when they exit): updates and deletes per table of the schema. With
    *timeline*, the topic is read back afterwards: every record's append time, each message
    id exactly once.
    """
    run = RelayRun(label, rows)
    expected = stop_after or rows
    watch = TopicWatch(ctx.bootstrap, topic)
    time.sleep(1.5)  # earlier statements' statistics flushed before the first read
    stats0 = table_stats(ctx.url)
    pg = ctx.pg or PgCpu(ctx.url)
    pg0 = pg.snapshot() if pg.postmaster else None
    ticks = cpu_ticks()
    relay = Relay(ctx, label, **settings)
    try:
        run.from_start_s = wait_drained(relay, watch, expected, max(120.0, expected / 500))
        if pg0 is not None:
            run.pg_cpu_s = pg.seconds(pg0, pg.snapshot())
        run.peak_rss_mb = relay.status("VmHWM")
        run.relay_cores = process_cpu_s(relay.proc.pid) / run.from_start_s
        run.machine_busy = busy_since(ticks)
    finally:
        relay.stop()
        watch.close()
    time.sleep(1.5)
    run.table_delta = stats_delta(stats0, table_stats(ctx.url))
    if not timeline:
        return run
    records = append_times(ctx.bootstrap, topic)
    ids = {mid for _, mid in records}
    if stop_after is None and (len(records) != rows or len(ids) != rows):
        raise RuntimeError(
            f"{topic} holds {len(records):,} records with {len(ids):,} distinct message ids "
            f"after the drain, not {rows:,} ({label})"
        )
    run.appended_at = sorted(t for t, _ in records)
    per_ms: dict[float, int] = {}
    for t in run.appended_at:
        per_ms[t] = per_ms.get(t, 0) + 1
    run.appends = len(per_ms)
    first, last = run.appended_at[0], run.appended_at[-1]
    run.first_to_last_s, run.first_append = last - first, per_ms[first]
    run.timeline = [(t - relay.started_wall, n) for t, n in per_ms.items()]
    return run


# --- filling the outbox ---------------------------------------------------------------------


def _emit_worker(engine_url: str, topic: str, worker: int, workers: int, n: int) -> int:
    """Every *workers*-th message from *worker* on, 1,000 per transaction.

    Workers get disjoint keys (KEYS is a multiple of *workers*): emit holds each key's
    advisory lock until commit, so overlapping keys in big transactions would deadlock.
    """
    from outbox.messages.emit import emit  # noqa: PLC0415
    from outbox.messages.envelope import Envelope  # noqa: PLC0415

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


def refill_from_template(ctx: Ctx, topic: str) -> None:
    """The template's rows, as emit wrote them, with fresh message ids, in emit order, all
    for *topic* (each drain has a topic of its own: Kafka's end offsets count it)."""
    reset_relays(ctx.url)
    psql(ctx.url, f"TRUNCATE {SCHEMA}.outbox_messages")
    psql(
        ctx.url,
        f"""
        INSERT INTO {SCHEMA}.outbox_messages
            (message_id, topic, key, lane, message_type, payload, headers, run_id)
        SELECT gen_random_uuid(), %s, key, lane, message_type, payload, headers, run_id
        FROM relaybench_template ORDER BY id
        """,
        [topic],
    )
    settle(ctx.url)


def fill_generated(ctx: Ctx, topic: str, n: int) -> float:
    """N pending rows straight from generate_series (emit is far too slow for 1M). Columns
    left out take their defaults: pending on either schema, before and after issue 14."""
    reset_relays(ctx.url)
    psql(ctx.url, f"TRUNCATE {SCHEMA}.outbox_messages")
    started = time.monotonic()
    psql(
        ctx.url,
        f"""
        INSERT INTO {SCHEMA}.outbox_messages
            (message_id, topic, key, lane, message_type, payload, headers)
        SELECT g.mid, %(topic)s, convert_to('key-' || lpad((g.i %% {KEYS})::text, 4, '0'), 'UTF8'),
               g.i %% {LANES}, 'bench.msg',
               convert_to('{{"seq":' || g.i || ',"data":"' || repeat(md5(g.i::text), 6)
                          || substr(md5(g.i::text || 'x'), 1, 18) || '"}}', 'UTF8'),
               jsonb_build_object('message-id', g.mid::text, 'message-type', 'bench.msg',
                                  'created-at', now()::text)
        FROM (SELECT i, gen_random_uuid() AS mid FROM generate_series(1, %(n)s) AS i) AS g
        """,
        {"topic": topic, "n": n},
    )
    took = time.monotonic() - started
    settle(ctx.url)
    return took


# --- (a) the producer alone -----------------------------------------------------------------


def kafka_headers(message_id: str, message_type: str, headers: dict[str, Any]) -> list[Any]:
    """The Kafka headers the relay sends for a row: a copy of relay.publisher.kafka_headers
    (the relay's row type changes with issue 14; the headers it sends do not)."""
    out = [("message-id", message_id.encode()), ("message-type", message_type.encode())]
    for name, value in headers.items():
        if value is not None and name not in ("message-id", "message-type"):
            out.append((name, str(value).encode()))
    return out


def load_template_messages(ctx: Ctx) -> list[tuple[str, bytes | None, bytes, list[Any]]]:
    """What the relay will send for the template rows: topic, key, value, headers."""
    out = []
    with psycopg.connect(ctx.url) as conn:
        for topic, mid, key, mtype, payload, headers in conn.execute(
            "SELECT topic, message_id, key, message_type, payload, headers "
            "FROM relaybench_template ORDER BY id"
        ):
            out.append(
                (
                    topic,
                    None if key is None else bytes(key),
                    bytes(payload),
                    kafka_headers(str(mid), mtype, dict(headers)),
                )
            )
    return out


def read_ceiling(ctx: Ctx) -> tuple[float, int]:
    """Seconds for one Python process to read the outbox's rows as a relay needs them
    (keyset pages of 1,000 by id, psycopg, text format as the relay's SQLAlchemy engine
    uses), connecting inside the timing; and how many rows it read."""
    query = (
        f"SELECT id, message_id, topic, key, message_type, payload, headers "
        f"FROM {SCHEMA}.outbox_messages WHERE id > %s ORDER BY id LIMIT 1000"
    )
    started = time.monotonic()
    rows, last = 0, 0
    with psycopg.connect(ctx.url) as conn:
        while page := conn.execute(query, [last]).fetchall():
            rows += len(page)
            last = page[-1][0]
        conn.rollback()
    return time.monotonic() - started, rows


def raw_ceiling(
    ctx: Ctx, messages: list[tuple[str, bytes | None, bytes, list[Any]]], client: str
) -> tuple[float, float, float]:
    """Seconds for one relay-configured producer of *client* to send every message and get
    every acknowledgement, with the CPU cores this process used and the fraction of the
    machine busy meanwhile.

    The clock starts before the producer is built (it connects and fetches the topic's
    metadata inside the timing, as the relay must), records are prepared beforehand. Sent
    through ``outbox.kafka``'s ``Producer.send`` (the relay's own path), 10,000 at a time.
    """
    from outbox.kafka import Outgoing  # noqa: PLC0415

    outgoing = [Outgoing(*m) for m in messages]
    ticks, cpu = cpu_ticks(), time.process_time()
    started = time.monotonic()
    publisher = make_publisher(ctx.bootstrap, kafka_client=client)
    producer = publisher.producer
    try:
        for at in range(0, len(outgoing), 10_000):
            sent = producer.send(outgoing[at : at + 10_000], timeout_s=120)
            if refused := [d.error for d in sent if d.error is not None]:
                raise RuntimeError(f"{len(refused)} records refused: {refused[0]}")
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
    from outbox.messages.emit import emit  # noqa: PLC0415
    from outbox.messages.envelope import Envelope  # noqa: PLC0415

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


def warm_up(ctx: Ctx, relay: Relay, watch: TopicWatch) -> None:
    """One message through the relay: producer connected, topic known, relay idle again."""
    from outbox.messages.emit import emit  # noqa: PLC0415
    from outbox.messages.envelope import Envelope  # noqa: PLC0415

    engine = create_engine(ctx.engine_url, pool_size=1)
    try:
        with engine.begin() as conn:
            emit(
                conn,
                Envelope(topic=watch.topic, type="bench.warmup", key="warm", payload={}),
                settings=OutboxSettings(schema_name=SCHEMA, lanes=LANES),
            )
    finally:
        engine.dispose()
    wait_drained(relay, watch, 1, timeout_s=120)
    time.sleep(1.5)  # let it find the outbox empty and declare itself idle


@dataclass
class Latency:
    label: str
    offered: float = math.nan
    achieved: float = math.nan
    kafka_ms: list[float] = field(default_factory=list)
    db_ms: list[float] = field(default_factory=list)
    db_source: str = ""
    missing: int = 0
    relay_cores: float = math.nan
    writer_cores: float = math.nan
    machine_busy: float = math.nan
    threads: dict[str, float] = field(default_factory=dict)  # the relay's cores per thread


def published_minus_created_ms(ctx: Ctx, topic: str) -> tuple[str, dict[str, float]]:
    """published_at - created_at per message id of *topic*, in ms (database clock), from
    the view message_status when it exists (issue 14), else from the columns it replaces.
    Read once, after the phase: the view is costly on big tables, this one is small."""
    source = "message_status" if has_relation(ctx.url, "message_status") else "outbox_messages"
    rows = psql(
        ctx.url,
        f"SELECT message_id::text, extract(epoch FROM published_at - created_at) * 1000 "
        f"FROM {SCHEMA}.{source} WHERE topic = %s AND status = 'published'",
        [topic],
    )
    return source, {mid: float(ms) for mid, ms in rows}


def latency(
    ctx: Ctx, label: str, *, deaf: bool, rate: float, seconds: float, writers: int,
    **settings: Any,
) -> Latency:
    """Writers at *rate* against one relay, NOTIFY-woken or (*deaf*) polling only."""
    topic = ctx.topic(f"lat-{label}")
    reset_relays(ctx.url)
    psql(ctx.url, f"TRUNCATE {SCHEMA}.outbox_messages")
    result = Latency(label, offered=rate)
    watch = TopicWatch(ctx.bootstrap, topic)
    relay = Relay(ctx, f"lat-{label}", deaf=deaf, **settings)
    try:
        warm_up(ctx, relay, watch)
        psql(ctx.url, "CHECKPOINT")  # no checkpoint debt from earlier phases in the timing
        ticks, relay_cpu = cpu_ticks(), process_cpu_s(relay.proc.pid)
        threads = thread_cpu_s(relay.proc.pid)
        start_at, committed, writer_cpu = run_writers(ctx, topic, rate, seconds, writers)
        last = max(t for _, t in committed)
        result.machine_busy = busy_since(ticks)
        result.relay_cores = (process_cpu_s(relay.proc.pid) - relay_cpu) / (last - start_at)
        result.threads = {
            name: (spent - threads.get(name, 0.0)) / (last - start_at)
            for name, spent in thread_cpu_s(relay.proc.pid).items()
        }
        result.writer_cores = writer_cpu / (last - start_at)
        result.achieved = len(committed) / (last - start_at)
        wait_drained(relay, watch, 1 + len(committed), timeout_s=120)
        relay.check_alive()
    finally:
        relay.stop()
        watch.close()
    # The first second is the relay and the writers settling: not steady state.
    steady = {mid: t for mid, t in committed if t >= start_at + 1.0}
    appended = {mid: t for t, mid in append_times(ctx.bootstrap, topic) if mid in steady}
    result.missing = len(steady) - len(appended)
    result.kafka_ms = [(appended[m] - t) * 1000 for m, t in steady.items() if m in appended]
    result.db_source, db = published_minus_created_ms(ctx, topic)
    result.db_ms = [ms for mid, ms in db.items() if mid in steady]
    return result


# --- (d) the cost of a backlog ---------------------------------------------------------------


def ms_per_1000(run: RelayRun, low: int, high: int) -> float:
    """Milliseconds per 1,000 records between the low-th and the high-th record's append
    (the relay running, its start-up behind it)."""
    times = run.appended_at
    if len(times) < high:
        raise RuntimeError(f"{run.label}: {len(times):,} records, the window needs {high:,}")
    return (times[high - 1] - times[low - 1]) * 1000 / ((high - low) / 1000)


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
        "confluent_kafka": confluent_version(),
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
    p.add_argument(
        "--clients",
        default="kafka-python,confluent",
        help="Kafka clients to measure side by side, the first is the default (comma "
        "separated; a client whose library is missing is left out with a note)",
    )
    p.add_argument("--state-dir", help="where the throwaway services live (kept if given)")
    p.add_argument("--rate", type=float, default=1000.0, help="offered load of (c), msgs/s")
    p.add_argument("--writers", type=int, default=4, help="writer processes of (c)")
    p.add_argument("--latency-seconds", type=float, help="length of (c) (default 15; quick 6)")
    p.add_argument(
        "--low-seconds", type=float, help="length of (c3) (default 10; quick 5; 0 skips it)"
    )
    p.add_argument(
        "--idle-seconds",
        type=float,
        help="length of (c4), 200 msgs/s from 2 writers (default 20; quick 8; 0 skips it)",
    )
    p.add_argument("--no-variants", action="store_true",
                   help="skip the variants of (b) (other batch sizes and lingers)")
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
        "clients": available_clients(args.clients),
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
        "idle_rate": 200.0,
        "idle_s": (8.0 if quick else 20.0) if args.idle_seconds is None else args.idle_seconds,
        "big_claim": args.claim_backlog or (100_000 if quick else 1_000_000),
        "big_rss": args.rss_backlog or (100_000 if quick else 200_000),
        "variants": [] if args.no_variants
        else [("batch 2000", {"batch_size": 2000})]
        if quick
        else [
            ("batch 500", {"batch_size": 500}),
            ("batch 2000", {"batch_size": 2000}),
            ("batch 5000", {"batch_size": 5000}),
            ("batch 1000, linger 0", {"batch_size": 1000, "linger_ms": 0}),
            ("batch 1000, linger 20", {"batch_size": 1000, "linger_ms": 20}),
        ],
    }




def available_clients(wanted: str) -> list[str]:
    clients = []
    for name in filter(None, (c.strip() for c in wanted.split(","))):
        if name == "confluent" and importlib.util.find_spec("confluent_kafka") is None:
            print("note: confluent-kafka is not installed: its figures are left out "
                  "(pip install 'outboxkit[confluent]')")
            continue
        clients.append(name)
    if not clients:
        raise SystemExit("no Kafka client to measure (--clients)")
    return clients


def nothing_to_restore() -> None:
    pass


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
            ("not checked (--allow-not-durable)", nothing_to_restore)
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
        f"{machine['postgres']}, kafka-python {machine['kafka_python']}, confluent-kafka "
        f"{machine['confluent_kafka']}; "
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
    ctx = Ctx(with_database(admin_url, db), bootstrap, prefix, logs, plan["quick"],
              client=plan["clients"][0])
    try:
        shown = show(ctx.url)
        if shown["fsync"] != "on" and plan["durable"]:
            raise SystemExit(f"REFUSED: fsync is {shown['fsync']} in the benchmark database")
        print(f"durability: {durability}")
        print(
            f"setup: N={plan['n']:,}, rounds={plan['rounds']}, {LANES} lanes, {KEYS} keys, "
            f"{PARTITIONS} partitions, quick={plan['quick']}; relay logs in {logs}"
        )
        ctx.pg = PgCpu(ctx.url)
        print(
            f"PostgreSQL CPU: the processes of postmaster {ctx.pg.postmaster} (from /proc)"
            if ctx.pg.postmaster
            else f"PostgreSQL CPU: not measured: {ctx.pg.why_not}"
        )
        return run_all(ctx, plan, samples)
    finally:
        for proc in list(ctx.relays):  # only relays this run started, should one be left
            with contextlib.suppress(Exception):
                proc.kill()
        with contextlib.suppress(Exception):
            psql(admin_url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        delete_topics(bootstrap, ctx.topics)


@dataclass
class Results:
    rounds: int = 0
    raw: list[float] = field(default_factory=list)
    raw_spent: list[Spent] = field(default_factory=list)
    read: list[float] = field(default_factory=list)  # read ceiling per round, msgs/s
    relay_runs: list[RelayRun] = field(default_factory=list)
    # The other clients' (a) and (b): {client: (producer alone per round, spent, drains)}.
    others: dict[str, tuple[list[float], list[Spent], list[RelayRun]]] = field(
        default_factory=dict)
    variants: list[tuple[str, RelayRun]] = field(default_factory=list)
    lat: dict[str, Latency] = field(default_factory=dict)
    head_small_ms: float = math.nan  # ms per 1,000 rows at the head of a 10k backlog
    head_large_ms: float = math.nan
    head_large_rows: int = 0
    head_window: tuple[int, int] = (0, 0)
    rss_small: RelayRun | None = None
    rss_large: RelayRun | None = None

    def kafka_ms(self, label: str) -> list[float]:
        """The latencies of phase ``label``; none when the phase was skipped."""
        lat = self.lat.get(label)
        return lat.kafka_ms if lat else []


def run_all(ctx: Ctx, plan: dict[str, Any], samples: dict[str, Any] | None = None) -> list[Figure]:
    from outbox.db.migrate import migrate  # noqa: PLC0415

    engine: Engine = create_engine(ctx.engine_url)
    try:
        migrate(engine)
    finally:
        engine.dispose()
    res = Results(rounds=plan["rounds"])
    phase_throughput(ctx, plan, res)
    phase_latency(ctx, plan, res)
    phase_backlog_and_memory(ctx, plan, res)
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


def drain_line(run: RelayRun) -> str:
    return (
        f"{run.rate:,.0f} msgs/s from spawn ({run.from_start_s:.2f} s), "
        f"{run.steady_rate:,.0f} msgs/s first→last append ({run.first_to_last_s:.2f} s, "
        f"{run.appends} append times), peak RSS {run.peak_rss_mb:.0f} MB, relay "
        f"{run.relay_cores:.2f} cores, PostgreSQL {run.pg_cpu_s:.2f} CPU s "
        f"({run.pg_cpu_us_per_msg:.1f} us/msg), machine {run.machine_busy:.0%} busy; "
        f"dead tuples {run.dead_per_msg:.4f}/msg: {stats_line(run.table_delta)}"
    )


def phase_throughput(ctx: Ctx, plan: dict[str, Any], res: Results) -> None:
    """(a), the read ceiling and (b), alternating round by round, then the variants of (b)
    once each; every drain publishes to a topic of its own."""
    n = plan["n"]
    template_topic = ctx.topic("tput")  # (a) sends here too
    log(f"emitting the {n:,}-row backlog (not timed)")
    took = fill_template(ctx, template_topic, n)
    print(
        f"\nfill: {n:,} rows by emit, 1,000 per transaction, 2 processes: {took:.1f} s "
        f"({n / took:,.0f} rows/s; not part of any figure). Every (b) round starts from a copy "
        "of these rows (fresh message ids, a topic of its own), VACUUM ANALYZE and CHECKPOINT."
    )
    messages = load_template_messages(ctx)
    print(
        "\n(a) producer alone (relay.publisher.Publisher's producer, of each Kafka client: "
        "acks=all, idempotence, linger 5 ms, batch 256 KiB, lz4, 5 in flight, through "
        "outbox.kafka's Producer.send, 10,000 records at a time), timed from building the "
        "producer to the last acknowledgement / (r) read ceiling: one Python process reads the "
        "same rows with psycopg, keyset pages of 1,000 by id, connecting inside the timing / "
        "(b) one relay process draining the same rows, timed from spawn until the topic's "
        "end offsets add up to N (checked every 50 ms; nothing reads PostgreSQL meanwhile); "
        "first→last append from the records' broker LogAppendTime. Retention is off "
        "(OUTBOXKIT_RELAY_PUBLISHED_RETENTION_SECONDS=0). PostgreSQL CPU: utime+stime of "
        "every process of the cluster, spawn to drained. Dead tuples: n_tup_upd + n_tup_del "
        "of the schema's tables (pg_stat_user_tables), spawn to the relay stopped."
    )
    first, *others = plan["clients"]
    if others:
        print(
            f"  (a) and (b) run with each Kafka client in turn, every round: {first} (the "
            f"default; the figures without a client in their name) and {', '.join(others)} "
            "(OUTBOXKIT_RELAY_KAFKA_CLIENT; figures named relay.<client>.* and "
            "kafka.<client>.*)."
        )
    for r in range(plan["rounds"]):
        log(f"round {r + 1}/{plan['rounds']}: (a) producer alone")
        took, cores, busy = raw_ceiling(ctx, messages, first)
        res.raw.append(n / took)
        res.raw_spent.append(Spent(n / took, cores, busy))
        print(
            f"  round {r + 1}: (a) {res.raw[-1]:,.0f} msgs/s ({took:.2f} s), producer "
            f"{cores:.2f} cores, machine {busy:.0%} busy"
        )
        for client in others:
            raws, spent, runs = res.others.setdefault(client, ([], [], []))
            log(f"round {r + 1}/{plan['rounds']}: (a) producer alone, {client}")
            took, cores, busy = raw_ceiling(ctx, messages, client)
            raws.append(n / took)
            spent.append(Spent(n / took, cores, busy))
            print(
                f"  round {r + 1}: (a, {client}) {raws[-1]:,.0f} msgs/s ({took:.2f} s), "
                f"producer {cores:.2f} cores, machine {busy:.0%} busy"
            )
            topic = ctx.topic(f"tput-{r + 1}-{client}")
            refill_from_template(ctx, topic)
            log(f"round {r + 1}/{plan['rounds']}: (b) relay, batch 1000, {client}")
            run = drain(ctx, f"tput-{r + 1}-{client}", topic, n, kafka_client=client)
            runs.append(run)
            print(f"  round {r + 1}: (b, {client}) {drain_line(run)}")
        topic = ctx.topic(f"tput-{r + 1}")
        refill_from_template(ctx, topic)
        log(f"round {r + 1}/{plan['rounds']}: (r) read ceiling")
        took, read = read_ceiling(ctx)
        if read != n:
            raise RuntimeError(f"the read ceiling read {read:,} rows, not {n:,}")
        res.read.append(n / took)
        print(f"  round {r + 1}: (r) {res.read[-1]:,.0f} msgs/s ({took:.2f} s)")
        log(f"round {r + 1}/{plan['rounds']}: (b) relay, batch 1000")
        run = drain(ctx, f"tput-{r + 1}", topic, n)
        res.relay_runs.append(run)
        print(f"  round {r + 1}: (b) {drain_line(run)}")
    for label, settings in plan["variants"]:
        log(f"(b) variant {label}")
        name = "tput-" + label.replace(" ", "").replace(",", "-")
        topic = ctx.topic(name)
        refill_from_template(ctx, topic)
        run = drain(ctx, name, topic, n, **settings)
        res.variants.append((label, run))
        print(f"  {label}: {drain_line(run)}")


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
        "clock, read once after the phase from the view message_status where it exists, "
        "else from outbox_messages' columns). c1 'notify': the default relay. c2 'poll': the "
        f"relay process alone gets OUTBOXKIT_NOTIFY_CHANNEL={DEAF_CHANNEL}, so it LISTENs "
        "where nobody notifies (emits still pg_notify the default channel while the relay is "
        "idle) and only its fallback poll wakes it, poll_interval_seconds at its default "
        "of 1.0 s."
    )
    low, idle = plan["low_rate"], plan["idle_rate"]
    print(
        f"  (c3, extra) the same at a low load, {low:.0f} msgs/s from 1 writer for "
        f"{plan['low_s']:.0f} s, where the relay is idle between messages and NOTIFY matters. "
        f"(c4) {idle:.0f} msgs/s from 2 writers for {plan['idle_s']:.0f} s: the relay's own "
        "CPU (its CPU seconds / the writers' wall seconds) and latency at a light load."
    )
    phases: list[tuple[str, bool, float, float, int, dict[str, Any]]] = [
        ("notify", False, rate, seconds, writers, {}),
        ("poll", True, rate, seconds, writers, {}),
        ("notify-low", False, low, plan["low_s"], 1, {}),
        ("poll-low", True, low, plan["low_s"], 1, {}),
        ("notify-200", False, idle, plan["idle_s"], 2, {}),
    ]
    for client in plan["clients"][1:]:  # c1 and c4 with each other client
        phases += [
            (f"notify-{client}", False, rate, seconds, writers, {"kafka_client": client}),
            (f"notify-200-{client}", False, idle, plan["idle_s"], 2, {"kafka_client": client}),
        ]
    for label, deaf, r, sec, w, settings in phases:
        if sec <= 0:
            continue
        log(f"(c) latency, {label}: {r:,.0f} msgs/s for {sec:.0f} s")
        lat = latency(ctx, label, deaf=deaf, rate=r, seconds=sec, writers=w, **settings)
        res.lat[label] = lat
        print(
            f"  {label}: offered {lat.offered:,.0f}/s, achieved {lat.achieved:,.0f}/s, "
            f"{len(lat.kafka_ms):,} messages measured ({lat.missing} not found in Kafka); "
            f"kafka p50 {pct(lat.kafka_ms, 50):.1f} p90 {pct(lat.kafka_ms, 90):.1f} "
            f"p99 {pct(lat.kafka_ms, 99):.1f} max {max(lat.kafka_ms, default=math.nan):.1f} ms; "
            f"db ({lat.db_source}) p50 {pct(lat.db_ms, 50):.1f} p99 {pct(lat.db_ms, 99):.1f} "
            f"ms; CPU: relay {lat.relay_cores:.3f} cores, writers {lat.writer_cores:.2f}, "
            f"machine {lat.machine_busy:.0%} busy (everyone's)"
        )
        busiest = sorted(lat.threads.items(), key=lambda item: -item[1])[:6]
        print("    relay threads (cores): "
              + ", ".join(f"{name} {cores:.3f}" for name, cores in busiest if cores >= 0.001))


def phase_backlog_and_memory(ctx: Ctx, plan: dict[str, Any], res: Results) -> None:
    """(d) what a big backlog costs the relay per 1,000 rows, (e) its peak memory.

    (d) used to time relay.claims.claim directly; issue 14 replaces that function, so the
    relay process itself is timed: the append times of its records between the 1,000th and
    the 9,000th, on a 10k and on a 1M-row backlog. The first 1,000 carry the start-up
    (imports, connections, lanes, the producer's metadata): left out; what remains is
    per-batch work (read, send, acknowledge, record) at the head of each backlog, so the
    ratio shows any cost that grows with the backlog. Publishing costs the same in both, so
    the ratio is diluted by it: a claim that doubles shows less than 2.
    """
    big_head, big_rss = plan["big_claim"], plan["big_rss"]
    low = 1000
    high = min(9000, min(10_000, big_head) - 1000)
    res.head_window = (low, high)
    log("(d)+(e) 10k pending rows")
    topic = ctx.topic("rss-10k")
    fill_generated(ctx, topic, 10_000)
    res.rss_small = drain(ctx, "rss-10k", topic, 10_000)
    if high > low:
        res.head_small_ms = ms_per_1000(res.rss_small, low, high)
    log(f"(d) {big_head:,} pending rows (generate_series, not timed)")
    topic = ctx.topic(f"head-{big_head}")
    took = fill_generated(ctx, topic, big_head)
    res.head_large_rows = big_head
    if high > low:
        run = drain(ctx, f"head-{big_head}", topic, big_head, stop_after=high)
        res.head_large_ms = ms_per_1000(run, low, high)
    print(
        f"\n(d) relay time per 1,000 rows between the {low:,}th and the {high:,}th record's "
        f"broker append (start-up excluded; lanes 0..63 filled evenly by INSERT … "
        f"generate_series, VACUUM ANALYZE): {res.head_small_ms:.1f} ms with 10k pending, "
        f"{res.head_large_ms:.1f} ms with {big_head:,} pending (fill {took:.0f} s)"
    )
    log(f"(e) {big_rss:,} pending rows")
    topic = ctx.topic(f"rss-{big_rss}")
    fill_generated(ctx, topic, big_rss)
    log(f"(e) draining {big_rss:,}")
    res.rss_large = drain(ctx, f"rss-{big_rss}", topic, big_rss, timeline=False)
    print(
        f"(e) relay peak RSS (VmHWM at the end of the drain): {res.rss_small.peak_rss_mb:.1f} "
        f"MB draining 10k ({res.rss_small.rate:,.0f} msgs/s), "
        f"{res.rss_large.peak_rss_mb:.1f} MB draining {big_rss:,} "
        f"({res.rss_large.rate:,.0f} msgs/s)"
    )


def median(values: list[float]) -> float:
    ok = [v for v in values if math.isfinite(v)]
    return statistics.median(ok) if ok else math.nan


def figures_of(res: Results) -> list[Figure]:
    assert res.rss_small is not None
    assert res.rss_large is not None
    ceiling = statistics.median(res.raw)
    b_rate = statistics.median(r.rate for r in res.relay_runs)
    b_steady = statistics.median(r.steady_rate for r in res.relay_runs)
    ratio = b_rate / ceiling
    steady_ratio = b_steady / ceiling
    read = statistics.median(res.read)
    bound = 1 / (1 / ceiling + 1 / read)
    bound_ratio = b_rate / bound
    pg_us = median([r.pg_cpu_us_per_msg for r in res.relay_runs])
    dead = median([r.dead_per_msg for r in res.relay_runs])
    head_ratio = res.head_large_ms / res.head_small_ms
    small, large = res.rss_small.peak_rss_mb, res.rss_large.peak_rss_mb
    peak = max(small, large)
    flat = large - small <= 20
    notify, poll = res.lat["notify"], res.lat["poll"]
    n_p50, n_p99 = pct(notify.kafka_ms, 50), pct(notify.kafka_ms, 99)
    idle = res.lat.get("notify-200")
    idle_cores = idle.relay_cores if idle else math.nan
    idle_p99 = pct(idle.kafka_ms, 99) if idle else math.nan
    low, high = res.head_window
    per_table: dict[str, int] = {}
    for run in res.relay_runs:
        for name, (upd, dele, _hot, _dead) in run.table_delta.items():
            per_table[name] = per_table.get(name, 0) + upd + dele
    where = ", ".join(f"{n} {v / len(res.relay_runs):,.0f}" for n, v in per_table.items() if v)
    figures = [
        Figure("kafka.producer_alone_msgs_per_s", ceiling, "msgs/s", note="median of rounds"),
        Figure(
            "relay.throughput_msgs_per_s",
            b_rate,
            "msgs/s",
            ceiling,
            ratio,
            note="from process spawn until the topic's end offsets reach N, batch 1000; "
            "median of rounds",
        ),
        Figure("relay.throughput_ratio", ratio, "ratio", ceiling, ratio, "≥ 0.8", ratio >= 0.8),
        Figure(
            "relay.throughput_msgs_per_s_steady",
            b_steady,
            "msgs/s",
            ceiling,
            steady_ratio,
            note="first to last record's broker append time (no start-up)",
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
        Figure(
            "relay.read_ceiling_msgs_per_s",
            read,
            "msgs/s",
            note="one Python process reading the same rows with psycopg, keyset pages of "
            "1,000 by id; median of rounds",
        ),
        Figure(
            "relay.bound_msgs_per_s",
            bound,
            "msgs/s",
            note="1 / (1 / producer alone + 1 / read ceiling): reading then sending, one "
            "after the other, each at its own ceiling",
        ),
        Figure(
            "relay.bound_ratio",
            bound_ratio,
            "ratio",
            bound,
            bound_ratio,
            "≥ 0.8",
            bound_ratio >= 0.8,
            note="relay throughput (from spawn) / bound",
        ),
        Figure(
            "relay.pg_cpu_us_per_msg",
            pg_us,
            "us",
            goal="≤ 15",
            met=pg_us <= 15,
            note="utime+stime of every process of the PostgreSQL cluster (postmaster, its "
            "children, exited ones through its cutime/cstime), spawn to drained, per relayed "
            "message; median of rounds",
        ),
        Figure(
            "relay.dead_tuples_per_msg",
            dead,
            "tuples",
            goal="≈ 0 (< 0.001)",
            met=dead < 0.001,
            note="n_tup_upd + n_tup_del of the schema's tables (pg_stat_user_tables), spawn "
            "to relay stopped, per message, retention off; median of rounds; per round: "
            f"{where or 'none'}",
        ),
    ]
    for client in res.others:
        figures += client_figures(client, read, res)
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
        Figure(
            "relay.latency_p50_ms_db",
            pct(notify.db_ms, 50),
            "ms",
            note=f"published_at - created_at from {notify.db_source}",
        ),
        Figure("relay.latency_p99_ms_db", pct(notify.db_ms, 99), "ms"),
        Figure("relay.latency_load_msgs_per_s", notify.achieved, "msgs/s", note="achieved"),
        Figure(
            "relay.idle_cores_200",
            idle_cores,
            "cores",
            goal="≤ 0.1",
            met=idle_cores <= 0.1,
            note=f"the relay's CPU seconds per wall second while 2 writers commit "
            f"{idle.achieved if idle else math.nan:,.0f} single-message transactions/s",
        ),
        Figure(
            "relay.latency_p99_ms_200",
            idle_p99,
            "ms",
            goal="≤ 25",
            met=idle_p99 <= 25,
            note="commit to broker append at 200 msgs/s (NOTIFY)",
        ),
        Figure(
            "relay.claim_ms_10k",
            res.head_small_ms,
            "ms",
            note=f"relay ms per 1,000 rows, {low:,}th to {high:,}th record's append, 10k pending",
        ),
        Figure(
            f"relay.claim_ms_{res.head_large_rows // 1000}k",
            res.head_large_ms,
            "ms",
            note=f"the same with {res.head_large_rows:,} pending",
        ),
        Figure(
            "relay.claim_backlog_ratio",
            head_ratio,
            "ratio",
            goal="≤ 1.5",
            met=head_ratio <= 1.5,
            note=f"relay process time per 1,000 rows at the head of a "
            f"{res.head_large_rows:,}-row vs a 10,000-row backlog, from broker append times "
            f"of records {low:,}..{high:,} (start-up excluded; no relay internals called). "
            "Sending costs the same in both, so a claim cost that grows shows diluted",
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


def client_figures(client: str, read: float, res: Results) -> list[Figure]:
    """(a), (b), c1 and c4 with another Kafka client, beside the default's figures."""
    raws, spent, runs = res.others[client]
    ceiling = statistics.median(raws)
    rate = statistics.median(r.rate for r in runs)
    bound = 1 / (1 / ceiling + 1 / read)
    pg_us = median([r.pg_cpu_us_per_msg for r in runs])
    goal = 40_000 if client == "confluent" else None
    figures = [
        Figure(f"kafka.{client}.producer_alone_msgs_per_s", ceiling, "msgs/s",
               note="median of rounds"),
        Figure(
            f"relay.{client}.throughput_msgs_per_s", rate, "msgs/s", ceiling, rate / ceiling,
            goal=None if goal is None else f"≥ {goal:,}",
            met=None if goal is None else rate >= goal,
            note="as relay.throughput_msgs_per_s, with OUTBOXKIT_RELAY_KAFKA_CLIENT="
            f"{client}; median of rounds",
        ),
        Figure(f"relay.{client}.throughput_ratio", rate / ceiling, "ratio", ceiling,
               rate / ceiling),
        Figure(f"relay.{client}.bound_ratio", rate / bound, "ratio", bound, rate / bound,
               note="relay throughput / (1 / (1 / producer alone + 1 / read ceiling))"),
        Figure(f"relay.{client}.pg_cpu_us_per_msg", pg_us, "us"),
        Figure(f"relay.{client}.peak_rss_mb", max(r.peak_rss_mb for r in runs), "MB"),
    ]
    cpus = os.cpu_count() or 1
    figures += cpu_budget(f"kafka.{client}.producer_alone", spent, ceiling, cpus)
    figures += cpu_budget(
        f"relay.{client}",
        [Spent(r.rate, r.relay_cores, r.machine_busy) for r in runs],
        ceiling,
        cpus,
    )
    if lat := res.lat.get(f"notify-{client}"):
        figures += [
            Figure(f"relay.{client}.latency_p50_ms", pct(lat.kafka_ms, 50), "ms"),
            Figure(f"relay.{client}.latency_p99_ms", pct(lat.kafka_ms, 99), "ms"),
        ]
    if idle := res.lat.get(f"notify-200-{client}"):
        figures += [
            Figure(f"relay.{client}.idle_cores_200", idle.relay_cores, "cores"),
            Figure(f"relay.{client}.latency_p99_ms_200", pct(idle.kafka_ms, 99), "ms"),
        ]
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
