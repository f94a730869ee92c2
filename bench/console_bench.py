"""The operator console on a big database: ``console.page_ms_1m``.

A throwaway database is loaded (``INSERT ... SELECT generate_series``) with 1,000,000 runs
(94 % done, 3 % failed, 1 % waiting, 1 % queued, 0.5 % needs-human, 0.5 % running),
1,000,000 outbox rows written by 1,000 transactions (published: the lanes' cursors are past
them; 1 % of them refused), 100,000 outside operations (200 needs-human, 300 unknown),
10,000 approvals (100 pending) and a run with a 40-step history. The console is served by
uvicorn in this process and each page is asked for *requests* times over HTTP on 127.0.0.1,
as JSON (what the page's reads cost, without the HTML) and as HTML; the time is from the
request to the last byte, so it includes loopback HTTP (about 1 ms here). Figures: the
median of each page, and ``console.page_ms_1m``, the slowest page's median, goal <= 100 ms
for the runs list, a run's page and the inbox (the issue's three). The other pages are
reported beside them.

``console.live_reads_per_min_20``: 20 overview streams open for *live-seconds* (refresh 2 s,
the default); how many times the overview was read (one reader for all), and
``console.live_pg_core_20``, the CPU the console's PostgreSQL backends used meanwhile (their
pids from pg_stat_activity's application_name, their CPU from /proc), as a share of a core.

    python bench/console_bench.py --database-url postgresql://postgres@host/postgres \\
        [--quick] [--json results.json] [--runs N] [--requests R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import urllib.request
import uuid
from typing import Any

from figures import Figure
from figures import print_table as print_figures
from sqlalchemy import Engine, create_engine, text

from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate
from outbox.db.queries import driver_sql
from outbox.settings import OutboxSettings

GOAL_MS = 100.0
# Outbox rows come from many transactions, as in a real outbox (the relay's queries read the
# writing transaction's id; one transaction of a million rows would mislead the planner).
_OUTBOX = """INSERT INTO outboxkit.outbox_messages (message_id, topic, key, lane, message_type,
           payload, run_id, created_at)
       SELECT gen_random_uuid(), 'order.submit', convert_to('k' || (g % 10000), 'UTF8'),
              g % :lanes, 'order.submit', convert_to('{"i": ' || g || '}', 'UTF8'), NULL,
              now() - interval '30 days' + g * interval '2 seconds'
       FROM generate_series(CAST(:first AS bigint), CAST(:last AS bigint)) AS g"""
PER_TRANSACTION = 1000
LANES = OutboxSettings().lanes

_LOAD = [
    """INSERT INTO outboxkit.agent_runs (id, workflow, workflow_version, state, step, reason,
           idempotency_key, created_at, updated_at, finished_at)
       SELECT gen_random_uuid(), 'wf-' || (g % 5), '1',
              CASE WHEN g % 200 = 1 THEN 'needs-human' WHEN g % 200 = 2 THEN 'running'
                   WHEN g % 100 = 3 THEN 'waiting' WHEN g % 100 = 4 THEN 'queued'
                   WHEN g % 100 IN (5, 6, 7) THEN 'failed' ELSE 'done' END,
              'step-' || (g % 50), 'because ' || g, 'run-' || g,
              now() - interval '30 days' + g * interval '2 seconds',
              now() - interval '30 days' + g * interval '2 seconds',
              now() - interval '30 days' + g * interval '2 seconds'
       FROM generate_series(1, :runs) AS g""",
    """INSERT INTO outboxkit.operations (id, idempotency_key, system, operation,
           request_digest, request, status, calls, checks, version, created_at, updated_at)
       SELECT gen_random_uuid(), 'op-' || g, 'supplier', 'place-order', 'sha256:x',
              '{"item": "widget"}'::jsonb,
              CASE WHEN g % 500 = 1 THEN 'needs-human' WHEN g % 500 IN (2, 3, 4) THEN 'unknown'
                   ELSE 'confirmed' END, 1, 0, 1,
              now() - interval '30 days' + g * interval '20 seconds',
              now() - interval '30 days' + g * interval '20 seconds'
       FROM generate_series(1, :operations) AS g""",
    """INSERT INTO outboxkit.approvals (id, run_id, scope, requested_at, expires_at,
           granted_by, granted_at)
       SELECT gen_random_uuid(), r.id, '{"tool": "refund"}'::jsonb, now(),
              now() + interval '1 day',
              CASE WHEN r.n % 100 <> 0 THEN 'ann' END,
              CASE WHEN r.n % 100 <> 0 THEN now() END
       FROM (SELECT id, row_number() OVER () AS n FROM outboxkit.agent_runs
             WHERE state = 'waiting' LIMIT :approvals) AS r""",
]


def load(engine: Engine, runs: int) -> uuid.UUID:
    """Fill the schema; the run whose page is asked for (40 history rows, messages, ops)."""
    migrate(engine)
    sizes = {"runs": runs, "operations": runs // 10,
             "approvals": max(runs // 100, 10)}
    with engine.begin() as conn:
        for statement in _LOAD:
            conn.execute(text(statement), sizes)
    with engine.connect() as conn:
        for first in range(1, runs + 1, PER_TRANSACTION):
            conn.execute(text(_OUTBOX), {"first": first, "lanes": LANES,
                                         "last": min(first + PER_TRANSACTION - 1, runs)})
            conn.commit()
    with engine.begin() as conn:
        conn.exec_driver_sql(driver_sql("relay", "ensure_lanes", "outboxkit"), {"lanes": LANES})
        # 1 % of the rows refused (outbox_failures), the rest published: cursors past them.
        conn.execute(text(
            "INSERT INTO outboxkit.outbox_failures (id, message_id, topic, key, lane, "
            "message_type, payload, headers, run_id, created_at, state, blocking, error) "
            "SELECT id, message_id, topic, key, lane, message_type, payload, headers, run_id, "
            "created_at, 'failed', false, 'too large' FROM outboxkit.outbox_messages "
            "WHERE id % 100 = 0"))
        page_run = conn.execute(text(
            "SELECT id FROM outboxkit.agent_runs WHERE idempotency_key = :k"),
            {"k": f"run-{runs // 2}"}).scalar_one()
        conn.execute(text(
            "INSERT INTO outboxkit.run_transitions (run_id, from_state, to_state, step, reason,"
            " actor, lease_token, at) SELECT :r, 'running', 'running', 'step-' || g, 'step', "
            "'w', g, now() FROM generate_series(1, 40) AS g"), {"r": page_run})
        conn.execute(text("UPDATE outboxkit.outbox_messages SET run_id = :r WHERE id <= 5"),
                     {"r": page_run})
        conn.execute(text("UPDATE outboxkit.operations SET run_id = :r WHERE idempotency_key "
                          "IN ('op-1', 'op-2')"), {"r": page_run})
    with engine.begin() as conn:  # a later transaction: its snapshot sees every row above
        conn.execute(text("UPDATE outboxkit.relay_lanes SET cursor_snapshot = "
                          "pg_current_snapshot()"))
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE"))
    return page_run


def ask(url: str, *, as_json: bool) -> float:
    headers = {"Accept": "application/json"} if as_json else {}
    started = time.perf_counter()
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 - loopback only
    with urllib.request.urlopen(request, timeout=60) as answer:  # noqa: S310
        answer.read()
        assert answer.status == 200, (url, answer.status)
    return (time.perf_counter() - started) * 1000


def serve(database_url: str, refresh: float) -> tuple[Any, threading.Thread, str]:
    import uvicorn  # noqa: PLC0415 - the console's extra

    from console import ConsoleSettings, create_app  # noqa: PLC0415

    app = create_app(ConsoleSettings(database_url=database_url, users="",
                                     refresh_seconds=refresh))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def _backend_cpu(engine: Engine) -> float:
    """CPU seconds used so far by the console's PostgreSQL backends (same machine: /proc)."""
    with engine.connect() as conn:
        pids = conn.execute(text("SELECT pid FROM pg_stat_activity WHERE application_name = "
                                 "'outboxkit-console'")).scalars().all()
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def live_reads(base: str, server: Any, streams: int, seconds: float,
               engine: Engine) -> tuple[int, float]:
    """Open *streams* overview streams for *seconds*; how many overview reads they caused,
    and the share of a core the console's PostgreSQL backends used meanwhile."""
    live = server.config.app.state.console.live
    before = live.reads
    cpu_before = _backend_cpu(engine)
    _listen(base, streams, seconds)
    return int(live.reads - before), (_backend_cpu(engine) - cpu_before) / seconds


def _postgres_cpu(engine: Engine) -> tuple[float, float]:
    """CPU seconds so far of every process of the PostgreSQL server (the postmaster's
    children, same machine), and of those that are the console's connections."""
    with engine.connect() as conn:
        backend = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        console = set(conn.execute(text("SELECT pid FROM pg_stat_activity WHERE "
                                        "application_name = 'outboxkit-console'")).scalars())
    postmaster = _stat(backend)[1]
    total = mine = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            seconds, parent = _stat(int(entry))
        except OSError:
            continue
        if parent == postmaster:
            total += seconds
            mine += seconds if int(entry) in console else 0.0
    return total, mine


def _stat(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[1])


def traffic_share(engine: Engine, url: str, bootstrap: str, base: str, *,
                  seconds: float, rate: int) -> dict[str, float]:
    """PostgreSQL's CPU while a writer emits *rate* messages a second that a relay
    publishes, for *seconds* without the console's pages, then as long with 20 open."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from outbox.messages.emit import emit_many  # noqa: PLC0415
    from outbox.messages.envelope import Envelope  # noqa: PLC0415

    topic = f"console-traffic-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "OUTBOXKIT_RELAY_DATABASE_URL": url,
           "OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP": bootstrap, "OUTBOXKIT_RELAY_RELAY_ID": "bench"}
    relay = subprocess.Popen([sys.executable, "-m", "relay"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()

    def write() -> None:
        n = 0
        tick = 0.01
        started = time.monotonic()
        while not stop.is_set():
            batch = [Envelope(topic=topic, type="t", key=f"k{(n + i) % 100}", payload={"n": n})
                     for i in range(int(rate * tick))]
            with engine.begin() as conn:
                emit_many(conn, batch)
            n += len(batch)
            time.sleep(max(0.0, started + n / rate - time.monotonic()))

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        time.sleep(5)  # the relay connects, takes its lanes and catches up
        cpu0 = _postgres_cpu(engine)
        time.sleep(seconds)
        cpu1 = _postgres_cpu(engine)
        pages = threading.Thread(target=lambda: _listen(base, 20, seconds + 1), daemon=True)
        pages.start()
        time.sleep(1)  # the pages open and the reader starts
        cpu2 = _postgres_cpu(engine)
        time.sleep(seconds)
        cpu3 = _postgres_cpu(engine)
        pages.join(timeout=seconds + 30)
    finally:
        stop.set()
        writer.join(timeout=30)
        relay.terminate()
        relay.wait(timeout=30)
    without = (cpu1[0] - cpu0[0]) / seconds
    with_pages = (cpu3[0] - cpu2[0]) / seconds
    console = (cpu3[1] - cpu2[1]) / seconds
    return {"without": without, "with_pages": with_pages, "console": console}


def _listen(base: str, streams: int, seconds: float) -> None:
    """Hold *streams* overview pages open for *seconds*."""
    stop = time.monotonic() + seconds

    def one() -> None:
        with urllib.request.urlopen(base + "/events", timeout=seconds + 30) as stream:  # noqa: S310
            for _ in stream:
                if time.monotonic() > stop:
                    return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 30)


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915 - one linear measurement
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOXKIT_DATABASE_URL"))
    parser.add_argument("--json", help="write the figures as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="a smoke run (20,000 runs)")
    parser.add_argument("--runs", type=int, help="runs and outbox rows (default 1,000,000)")
    parser.add_argument("--requests", type=int, help="requests per page (default 25)")
    parser.add_argument("--live-seconds", type=float, help="how long 20 streams stay open")
    parser.add_argument("--kafka-bootstrap", help="also measure the live pages beside relay "
                        "traffic (a writer and a relay; not in the suite)")
    parser.add_argument("--traffic-rate", type=int, default=1000, help="messages/s written")
    parser.add_argument("--traffic-seconds", type=float, default=20.0)
    parser.add_argument("--allow-not-durable", action="store_true", help="accepted for the suite")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("give --database-url or set OUTBOXKIT_DATABASE_URL")
    runs = args.runs or (20_000 if args.quick else 1_000_000)
    requests = args.requests or (5 if args.quick else 25)
    live_seconds = args.live_seconds or (3.0 if args.quick else 20.0)

    name = f"outboxkit_console_{uuid.uuid4().hex[:8]}"
    admin = create_engine(sqlalchemy_url(args.database_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = with_database(args.database_url, name)
    engine = create_engine(sqlalchemy_url(url))
    try:
        started = time.monotonic()
        page_run = load(engine, runs)
        print(f"loaded {runs:,} runs and {runs:,} outbox rows in "
              f"{time.monotonic() - started:.0f} s", flush=True)
        server, thread, base = serve(url, refresh=2.0)
        try:
            deep = ask_cursor(base, runs)
            pages = {
                "runs": "/runs", "runs_failed": "/runs?state=failed",
                "runs_deep": f"/runs?before={deep}", "run": f"/runs/{page_run}",
                "inbox": "/inbox", "overview": "/", "messages": "/messages",
                "runs_search_key": f"/runs?q=run-{runs // 3}",
            }
            times: dict[str, list[float]] = {p: [] for p in pages}
            html: dict[str, list[float]] = {p: [] for p in pages}
            for path in pages.values():  # warm: caches, prepared plans
                ask(base + path, as_json=True)
            for _ in range(requests):
                for page, path in pages.items():
                    times[page].append(ask(base + path, as_json=True))
                    html[page].append(ask(base + path, as_json=False))
            one_read = statistics.median(times["overview"])
            reads, pg_core = live_reads(base, server, 20, live_seconds, engine)
            traffic = (traffic_share(engine, url, args.kafka_bootstrap, base,
                                     seconds=args.traffic_seconds, rate=args.traffic_rate)
                       if args.kafka_bootstrap else None)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    med = {p: statistics.median(v) for p, v in times.items()}
    med_html = {p: statistics.median(v) for p, v in html.items()}
    for page in pages:
        print(f"{page:18} json {med[page]:8.1f} ms   html {med_html[page]:8.1f} ms")
    goal_pages = ("runs", "runs_failed", "runs_deep", "run", "inbox")
    worst = max(goal_pages, key=lambda p: max(med[p], med_html[p]))
    worst_ms = max(med[worst], med_html[worst])
    per_min = reads * 60 / live_seconds
    figures = [
        Figure("console.page_ms_1m", worst_ms, "ms", None, None, f"<= {GOAL_MS:.0f}",
               worst_ms <= GOAL_MS,
               note=f"slowest of the runs list (all, failed, a deep page), a run's page and the "
               f"inbox with {runs:,} runs and outbox rows: {worst}, median of {requests}, "
               "HTTP on loopback included"),
        *[Figure(f"console.{page}_ms", max(med[page], med_html[page]), "ms",
                 note=f"median, json {med[page]:.1f} / html {med_html[page]:.1f} ms")
          for page in pages],
        Figure("console.live_reads_per_min_20", per_min, "reads/min",
               note=f"20 open overview streams for {live_seconds:.0f} s caused {reads} reads "
               f"(refresh 2 s: one reader for all); one read ~{one_read:.0f} ms"),
        Figure("console.live_pg_core_20", pg_core * 100, "% of a core",
               note="CPU of the console's PostgreSQL backends while 20 overview pages were "
               "open (pg_stat_activity's pids, /proc)"),
        *([] if traffic is None else [Figure(
            "console.live_pg_share_traffic", traffic["console"] / traffic["without"] * 100,
            "% of PostgreSQL", goal="<= 5",
            met=traffic["console"] / traffic["without"] <= 0.05,
            note=f"the console's backends beside {args.traffic_rate:,} msg/s of relay traffic "
            f"(a writer's emit_many and a relay): PostgreSQL used {traffic['without']:.1%} of a "
            f"core without pages, {traffic['with_pages']:.1%} with 20 open, of which the "
            f"console's own backends {traffic['console']:.1%}")]),
    ]
    print()
    print_figures(figures)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"runs": runs, "requests": requests, "samples_ms": times,
                       "samples_html_ms": html, "figures": [f.as_json() for f in figures]},
                      out, indent=2)
        print(f"wrote {args.json}")
    return 0


def ask_cursor(base: str, runs: int) -> str:
    """A cursor about halfway down the runs list (walked to through the pages' cursors would
    take thousands of requests: the same cursor, built from the run at that position)."""
    from datetime import UTC, datetime, timedelta  # noqa: PLC0415

    from console.reads import encode_cursor  # noqa: PLC0415

    del base
    when = datetime.now(UTC) - timedelta(days=30) + timedelta(seconds=2 * (runs // 2))
    return encode_cursor(when, uuid.UUID(int=0))


if __name__ == "__main__":
    raise SystemExit(main())
