"""What an outbox message costs an agent step, on durable PostgreSQL.

One step = one transaction: the fenced checkpoint write of the run row (lease token and
version checked in the UPDATE, ``outbox.runs.lifecycle.save_checkpoint``) and, in the "+msg"
variant, one message emitted with the same lease (``outbox.messages.emit.emit``), then COMMIT.
Measured for the sync API, the async API, and raw psycopg (the same UPDATE, and UPDATE +
plain INSERT) in the same run, with 4 and 16 concurrent workers; each worker is its own
process with its own connection and its own run (processes, because two cores and the GIL
make Python threads the bottleneck; one threads row shows it). Medians of the rounds.

The server is made durable for the run (``ALTER SYSTEM SET fsync, synchronous_commit,
full_page_writes = on`` + reload) and restored afterwards. If that does not take effect
(e.g. fsync was set on the server's command line, which ALTER SYSTEM cannot override) the
benchmark refuses to run. It works in a database of its own, created and dropped here.

Then ``outbox.emit_many_rows_per_s``: one process emitting transactions of 1,000 messages
(1,000 distinct keys, ~200-byte payloads) with ``emit_many`` and committing, against the old
path (one statement per message, as emit_many did before issue 14) measured in the same
rounds, back to back, order alternating. Building the envelopes is not timed (the caller's
work); validating and encoding them is.

    python bench/outbox_steps.py --database-url postgresql://postgres@host/postgres \\
        [--quick] [--json results.json] [--emit-many-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from durable import make_durable, show  # bench/durable.py (this folder is on sys.path)
from figures import Figure
from figures import print_table as print_figures
from psycopg.types.json import Jsonb

PATHS = ("sync", "async", "raw-sql")
TOPIC = "bench.steps"


def _lease(url: str, run_id: uuid.UUID) -> Any:
    from outbox.runs.leases import Lease  # noqa: PLC0415

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT lease_token, version FROM outboxkit.agent_runs WHERE id = %s", [run_id]
        ).fetchone()
    assert row is not None
    return Lease(run_id, "bench", row[0], row[1], datetime.now(UTC) + timedelta(hours=1))


def _envelope(run_id: uuid.UUID, n: int) -> Any:
    from outbox.messages.envelope import Envelope  # noqa: PLC0415

    return Envelope(
        topic=TOPIC,
        type="step.done",
        key=str(run_id),
        payload={"run": str(run_id), "step": n, "result": "ok " * 30},
    )


def _checkpoint(n: int) -> dict[str, Any]:
    return {"step": n, "notes": "x" * 100}


def _run_sync(
    url: str, run_id: uuid.UUID, with_message: bool, seconds: float, go: Callable[[], float]
) -> int:
    from sqlalchemy import create_engine  # noqa: PLC0415

    from outbox.db.dsn import sqlalchemy_url  # noqa: PLC0415
    from outbox.messages.emit import emit  # noqa: PLC0415
    from outbox.runs.lifecycle import save_checkpoint  # noqa: PLC0415

    engine = create_engine(sqlalchemy_url(url), pool_size=1)
    lease = _lease(url, run_id)
    steps = 0
    try:
        with engine.connect() as conn:

            def step(n: int) -> None:
                nonlocal lease
                lease = save_checkpoint(conn, lease, _checkpoint(n), step=f"s{n}")
                if with_message:
                    emit(conn, _envelope(run_id, n), lease=lease)
                conn.commit()

            for n in range(20):  # warm up: prepared statements, caches
                step(n)
            end = go() + seconds
            while time.time() < end:
                step(steps)
                steps += 1
    finally:
        engine.dispose()
    return steps


def _run_async(
    url: str, run_id: uuid.UUID, with_message: bool, seconds: float, go: Callable[[], float]
) -> int:
    from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415

    from outbox import aio  # noqa: PLC0415
    from outbox.db.dsn import sqlalchemy_url  # noqa: PLC0415

    async def main() -> int:
        engine = create_async_engine(sqlalchemy_url(url), pool_size=1)
        lease = _lease(url, run_id)
        steps = 0
        try:
            async with engine.connect() as conn:

                async def step(n: int) -> None:
                    nonlocal lease
                    lease = await aio.save_checkpoint(conn, lease, _checkpoint(n), step=f"s{n}")
                    if with_message:
                        await aio.emit(conn, _envelope(run_id, n), lease=lease)
                    await conn.commit()

                for n in range(20):
                    await step(n)
                end = go() + seconds  # blocks the loop on purpose: nothing else runs in it
                while time.time() < end:
                    await step(steps)
                    steps += 1
        finally:
            await engine.dispose()
        return steps

    return asyncio.run(main())


_RAW_UPDATE = """
    UPDATE outboxkit.agent_runs
    SET checkpoint = %s, step = %s, version = version + 1, updated_at = now()
    WHERE id = %s AND lease_token = %s AND version = %s AND state = 'running'
    RETURNING version"""
_RAW_INSERT = """
    INSERT INTO outboxkit.outbox_messages
        (message_id, topic, key, lane, message_type, payload, headers, run_id)
    VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"""


def _run_raw(
    url: str, run_id: uuid.UUID, with_message: bool, seconds: float, go: Callable[[], float]
) -> int:
    lease = _lease(url, run_id)
    token, version = lease.token, lease.version
    payload = json.dumps({"run": str(run_id), "result": "ok " * 30}).encode()
    headers = Jsonb({"message-type": "step.done"})
    steps = 0
    with psycopg.connect(url) as conn:

        def step(n: int) -> None:
            nonlocal version
            row = conn.execute(
                _RAW_UPDATE, [Jsonb(_checkpoint(n)), f"s{n}", run_id, token, version]
            ).fetchone()
            assert row is not None, "lease lost"
            version = row[0]
            if with_message:
                conn.execute(
                    _RAW_INSERT,
                    [
                        uuid.uuid4(),
                        TOPIC,
                        str(run_id).encode(),
                        0,
                        "step.done",
                        payload,
                        headers,
                        run_id,
                    ],
                )
            conn.commit()

        for n in range(20):
            step(n)
        end = go() + seconds
        while time.time() < end:
            step(steps)
            steps += 1
    return steps


# A runner warms up (connects, prepares statements), then calls go(), which returns once every
# worker of the measurement is warm: the start time they all count from.
Runner = Callable[[str, uuid.UUID, bool, float, Callable[[], float]], int]
RUNNERS: dict[str, Runner] = {"sync": _run_sync, "async": _run_async, "raw-sql": _run_raw}


def _worker(tasks: Any, results: Any) -> None:
    """A long-lived worker process: run each task it is given, report its step count."""
    import outbox.aio  # noqa: PLC0415  # pay for imports once, before any measurement
    import outbox.messages.emit  # noqa: F401, PLC0415

    results.put(("up", 0))

    def go() -> float:
        results.put(("ready", 0))
        start: float = tasks.get()
        time.sleep(max(0.0, start - time.time()))
        return start

    while (task := tasks.get()) is not None:
        path, url, run_id, with_message, seconds = task
        try:
            results.put(("ok", RUNNERS[path](url, run_id, with_message, seconds, go)))
        except BaseException as exc:  # reported to the parent, which stops the benchmark
            results.put(("error", repr(exc)))


class Pool:
    """Worker processes started once (spawning per measurement would cost seconds)."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.procs = [
            ctx.Process(target=_worker, args=(q, self.results), daemon=True) for q in self.tasks
        ]
        for proc in self.procs:
            proc.start()
        self._expect("up", size)

    def _expect(self, status: str, count: int) -> list[int]:
        values = []
        for _ in range(count):
            got, value = self.results.get(timeout=600)
            if got != status:
                raise RuntimeError(f"a worker failed: {value}")
            values.append(value)
        return values

    def run(self, tasks: list[tuple[Any, ...]]) -> list[int]:
        for queue, task in zip(self.tasks, tasks, strict=False):
            queue.put(task)
        self._expect("ready", len(tasks))
        start = time.time() + 0.05
        for queue in self.tasks[: len(tasks)]:
            queue.put(start)
        return self._expect("ok", len(tasks))

    def close(self) -> None:
        for queue in self.tasks:
            queue.put(None)
        for proc in self.procs:
            proc.join(timeout=10)


def measure(
    pool: Pool,
    url: str,
    runs: list[uuid.UUID],
    *,
    path: str,
    mode: str,
    clients: int,
    with_message: bool,
    seconds: float,
) -> float:
    """Steps per second of *clients* workers over *seconds*, all counting from one start."""
    tasks = [(path, url, runs[i], with_message, seconds) for i in range(clients)]
    if mode == "processes":
        return sum(pool.run(tasks)) / seconds
    counts = [0] * clients
    start = [0.0]
    barrier = threading.Barrier(clients, action=lambda: start.__setitem__(0, time.time()))

    def go() -> float:
        barrier.wait()
        return start[0]

    def work(i: int) -> None:
        counts[i] = RUNNERS[path](url, runs[i], with_message, seconds, go)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / seconds


# --- setup ----------------------------------------------------------------------------------


def create_database(admin_dsn: str) -> tuple[str, str]:
    from outbox.db.dsn import with_database  # noqa: PLC0415

    name = f"outboxkit_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, with_database(admin_dsn, name)


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def prepare(url: str, workers: int) -> list[uuid.UUID]:
    """Migrate, and give every worker a running run it holds the lease of."""
    from sqlalchemy import create_engine  # noqa: PLC0415

    from outbox.db.dsn import sqlalchemy_url  # noqa: PLC0415
    from outbox.db.migrate import migrate  # noqa: PLC0415

    engine = create_engine(sqlalchemy_url(url))
    try:
        migrate(engine)
    finally:
        engine.dispose()
    runs = [uuid.uuid4() for _ in range(workers)]
    with psycopg.connect(url) as conn:
        for run_id in runs:
            conn.execute(
                "INSERT INTO outboxkit.agent_runs (id, workflow, workflow_version, state, "
                "idempotency_key, lease_owner, lease_token, lease_expires_at, version) "
                "VALUES (%s, 'bench', '1', 'running', %s, 'bench', 1, "
                "now() + interval '1 day', 0)",
                [run_id, str(run_id)],
            )
    return runs


def reset_outbox(url: str) -> None:
    """Start each round with an empty outbox, as a relay keeping up would leave it."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit.outbox_messages")
        conn.execute("VACUUM ANALYZE outboxkit.agent_runs")


# --- emit_many: rows per second of one process ----------------------------------------------

BATCH = 1000
BATCH_KEYS = 1000  # as bench/relay_bench.py: key-0000 .. key-0999
EMIT_MANY_GOAL = 20_000.0


def _batch_envelopes(transactions: int, size: int) -> list[list[Any]]:
    """*transactions* lists of *size* envelopes: distinct keys, ~200-byte JSON payloads."""
    from outbox.messages.envelope import Envelope  # noqa: PLC0415

    return [
        [
            Envelope(
                topic="bench.emit",
                type="bench.msg",
                key=f"key-{i % BATCH_KEYS:04d}",
                payload={"seq": t * size + i, "data": os.urandom(90).hex()},
            )
            for i in range(size)
        ]
        for t in range(transactions)
    ]


def _emit_one_by_one(conn: Any, envelopes: list[Any]) -> None:
    """The old emit_many, kept here only to measure against: one statement per message,
    locks in the same global order (sorted by lock key, stable)."""
    from outbox.messages.emit import emit  # noqa: PLC0415
    from outbox.messages.envelope import encode  # noqa: PLC0415
    from outbox.messages.lanes import ordering_lock_key  # noqa: PLC0415
    from outbox.settings import default_settings  # noqa: PLC0415

    settings = default_settings()

    def order(envelope: Any) -> int:
        message = encode(envelope, settings)
        lock = ordering_lock_key(message.topic, message.key)
        return lock if lock is not None else -(2**63) - 1

    for envelope in sorted(envelopes, key=order):
        emit(conn, envelope, settings=settings)


def _emit_many(conn: Any, envelopes: list[Any]) -> None:
    from outbox.messages.emit import emit_many  # noqa: PLC0415

    emit_many(conn, envelopes)


def _encode_us_per_msg(envelopes: list[Any]) -> float:
    """CPU microseconds per message of validating and encoding alone
    (outbox.messages.envelope.encode, which emit_many runs for every envelope): what no statement
    shape can save."""
    from outbox.messages.envelope import encode  # noqa: PLC0415
    from outbox.settings import default_settings  # noqa: PLC0415

    settings = default_settings()
    started = time.process_time()
    for envelope in envelopes:
        encode(envelope, settings)
    return (time.process_time() - started) / len(envelopes) * 1e6


EMIT_PATHS: dict[str, Callable[[Any, list[Any]], None]] = {
    "emit_many": _emit_many,
    "one_by_one": _emit_one_by_one,
}


def emit_many_rounds(
    admin_dsn: str, *, rounds: int, transactions: int, size: int = BATCH
) -> dict[str, list[float]]:
    """Rows/s of each path, once per round, in a throwaway database (one process: this one)."""
    from sqlalchemy import create_engine  # noqa: PLC0415

    from outbox.db.dsn import sqlalchemy_url  # noqa: PLC0415

    name, url = create_database(admin_dsn)
    samples: dict[str, list[float]] = {path: [] for path in EMIT_PATHS}
    samples["encode_us_per_msg"] = []
    engine = create_engine(sqlalchemy_url(url), pool_size=1)
    try:
        prepare(url, 0)
        print(
            f"emit_many: database {name} | {transactions} transactions of {size} messages x "
            f"{rounds} rounds | fsync={show(url)['fsync']}",
            flush=True,
        )
        # Warm up: psycopg prepares a statement on its 5th execution; imports, caches.
        for warm in _batch_envelopes(6, 20):
            for emit_path in EMIT_PATHS.values():
                with engine.begin() as conn:
                    emit_path(conn, warm)
        for round_no in range(rounds):
            order = list(EMIT_PATHS) if round_no % 2 == 0 else list(reversed(EMIT_PATHS))
            for path in order:
                reset_outbox(url)
                batches = _batch_envelopes(transactions, size)  # not timed: the caller's work
                started = time.perf_counter()
                for envelopes in batches:
                    with engine.begin() as conn:  # commits: durable, one fsync per batch
                        EMIT_PATHS[path](conn, envelopes)
                took = time.perf_counter() - started
                samples[path].append(transactions * size / took)
            samples["encode_us_per_msg"].append(_encode_us_per_msg(_batch_envelopes(1, size)[0]))
            print(
                f"emit_many round {round_no + 1}/{rounds}: "
                + ", ".join(f"{p} {samples[p][-1]:,.0f} rows/s" for p in EMIT_PATHS),
                flush=True,
            )
        with engine.connect() as conn:  # every message of the last round and path is there
            from sqlalchemy import text  # noqa: PLC0415

            rows = conn.execute(text("SELECT count(*) FROM outboxkit.outbox_messages")).scalar()
        assert rows == transactions * size, f"{rows} rows, expected {transactions * size}"
    finally:
        engine.dispose()
        drop_database(admin_dsn, name)
    return samples


def emit_many_figures(samples: dict[str, list[float]], judged: bool) -> list[Figure]:
    bulk, old = samples["emit_many"], samples["one_by_one"]
    rate = statistics.median(bulk)
    old_rate = statistics.median(old)
    # Both paths run back to back in every round: the per-round ratio cancels drift in load.
    ratios = [b / o for b, o in zip(bulk, old, strict=True)]
    ratio = statistics.median(ratios)
    encode_us = statistics.median(samples["encode_us_per_msg"])
    shape = f"1 process, transactions of {BATCH:,} messages ({BATCH_KEYS:,} keys), durable"
    return [
        Figure(
            "outbox.emit_many_rows_per_s",
            rate,
            "rows/s",
            goal=f"≥ {EMIT_MANY_GOAL:,.0f}",
            met=rate >= EMIT_MANY_GOAL if judged else None,
            note=f"{shape}; median of {len(bulk)} rounds {[round(b) for b in bulk]}; "
            "envelopes built beforehand (not timed)",
        ),
        Figure(
            "outbox.emit_many_rows_per_s_one_by_one",
            old_rate,
            "rows/s",
            note=f"the old path (one statement per message) in the same rounds: "
            f"{[round(o) for o in old]}",
        ),
        Figure(
            "outbox.emit_many_encode_us_per_msg",
            encode_us,
            "us",
            note=f"CPU per message of outbox.messages.envelope.encode alone (validation, JSON, "
            f"headers, size), median of rounds: one process cannot pass {1e6 / encode_us:,.0f} "
            "rows/s even with a free database",
        ),
        Figure(
            "outbox.emit_many_speedup",
            ratio,
            "ratio",
            old_rate,
            ratio,
            note=f"emit_many / one statement per message, median of per-round ratios "
            f"{[round(r, 2) for r in ratios]}; ceiling column = the old path's rows/s",
        ),
    ]


# --- main ----------------------------------------------------------------------------------


def run_rounds(
    admin_dsn: str,
    *,
    clients: list[int],
    modes: list[tuple[str, str]],
    seconds: float,
    rounds: int,
) -> dict[str, list[float]]:
    """Every (path, mode, clients, variant) measured once per round, in a throwaway database."""
    name, url = create_database(admin_dsn)
    pool = Pool(max(clients))
    samples: dict[str, list[float]] = {}
    try:
        print(
            f"database {name} | {seconds:g} s x {rounds} rounds | cores {os.cpu_count()} | "
            f"fsync={show(url)['fsync']}",
            flush=True,
        )
        runs = prepare(url, max(clients))
        for round_no in range(rounds):
            reset_outbox(url)
            # Alternate which variant goes first, so drift does not favour one.
            order = (False, True) if round_no % 2 == 0 else (True, False)
            for count in clients:
                for mode, path in modes:
                    for with_message in order:
                        rate = measure(
                            pool,
                            url,
                            runs,
                            path=path,
                            mode=mode,
                            clients=count,
                            with_message=with_message,
                            seconds=seconds,
                        )
                        key = f"{path}|{mode}|{count}|{'msg' if with_message else 'plain'}"
                        samples.setdefault(key, []).append(rate)
            print(f"round {round_no + 1}/{rounds} done", flush=True)
    finally:
        pool.close()
        drop_database(admin_dsn, name)
    return samples


def summarise(
    samples: dict[str, list[float]], clients: list[int], modes: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    rows = []
    for count in clients:
        for mode, path in modes:
            base = f"{path}|{mode}|{count}"
            plain, msg = samples[f"{base}|plain"], samples[f"{base}|msg"]
            rows.append(
                {
                    "path": path,
                    "mode": mode,
                    "clients": count,
                    "steps_per_s_plain": round(statistics.median(plain), 1),
                    "steps_per_s_with_message": round(statistics.median(msg), 1),
                    # Each round measures both back to back, so the per-round ratio cancels
                    # drift in machine load; its median is the figure.
                    "ratio": round(statistics.median(
                        m / p for m, p in zip(msg, plain, strict=True)), 3),
                    "ratio_per_round": [round(m / p, 3) for m, p in zip(msg, plain, strict=True)],
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> bool:
    """Print the results; True when outboxkit's ratio reached 0.8 at every client count."""
    header = (
        f"{'path':8} {'mode':9} {'clients':>7} {'step/s':>9} {'+msg/s':>9} {'ratio':>6}  "
        "per-round ratios"
    )
    print(f"\n{header}\n{'-' * len(header)}")
    for row in rows:
        print(
            f"{row['path']:8} {row['mode']:9} {row['clients']:>7} "
            f"{row['steps_per_s_plain']:>9.0f} {row['steps_per_s_with_message']:>9.0f} "
            f"{row['ratio']:>6.2f}  {row['ratio_per_round']}"
        )
    met = all(
        float(r["ratio"]) >= 0.8
        for r in rows
        if r["mode"] == "processes" and r["path"] != "raw-sql"
    )
    print(f"\ngoal (outboxkit ratio >= 0.8 at every client count): {'met' if met else 'NOT met'}")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOXKIT_DATABASE_URL"))
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--seconds", type=float, help="length of one measurement")
    parser.add_argument(
        "--rounds", type=int, help="rounds (the median is reported; >= 3 unless --quick)"
    )
    parser.add_argument("--clients", default="4,16", help="comma-separated worker counts")
    parser.add_argument("--no-threads", action="store_true", help="skip the threads row")
    parser.add_argument(
        "--emit-many-transactions",
        type=int,
        help="transactions of 1,000 messages per path and round for emit_many (default 10; "
        "2 with --quick)",
    )
    parser.add_argument(
        "--emit-many-only", action="store_true", help="measure emit_many only, not the steps"
    )
    parser.add_argument(
        "--allow-not-durable",
        action="store_true",
        help="leave the server's durability as it is (a smoke run on a test server; figures "
        "then mean nothing)",
    )
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("give --database-url or set OUTBOXKIT_DATABASE_URL")
    seconds = args.seconds or (0.5 if args.quick else 2.0)
    # A median needs rounds; a smoke run (--quick) may ask for fewer to be quick.
    rounds = args.rounds if args.quick and args.rounds else max(3, args.rounds or 3)
    clients = [int(c) for c in args.clients.split(",")]
    modes = [("processes", path) for path in PATHS]
    if not args.no_threads:
        modes.append(("threads", "sync"))

    restore: Callable[[], None]
    durability, restore = (
        ("not checked (--allow-not-durable)", lambda: None)
        if args.allow_not_durable
        else make_durable(args.database_url)
    )
    transactions = args.emit_many_transactions or (2 if args.quick else 10)
    print(f"durability: {durability}", flush=True)
    samples: dict[str, list[float]] = {}
    try:
        if not args.emit_many_only:
            samples = run_rounds(
                args.database_url, clients=clients, modes=modes, seconds=seconds, rounds=rounds
            )
        emit_samples = emit_many_rounds(
            args.database_url, rounds=rounds, transactions=transactions
        )
    finally:
        restore()
    print(f"server settings restored: {show(args.database_url)}")
    rows = [] if args.emit_many_only else summarise(samples, clients, modes)
    if rows:
        print_table(rows)
    figures = emit_many_figures(emit_samples, judged=not args.allow_not_durable)
    print()
    print_figures(figures)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(
                {
                    "durability": durability,
                    "seconds": seconds,
                    "rounds": rounds,
                    "cores": os.cpu_count(),
                    "python": sys.version.split()[0],
                    "rows": rows,
                    "samples": samples,
                    "figures": [f.as_json() for f in figures],
                    "emit_many_samples": emit_samples,
                },
                out,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
