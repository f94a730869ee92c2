"""What a fan-out and its join cost against plain steps: ``outbox.fanout_children_per_s``.

4 worker processes (``outbox.worker.run_worker``, concurrency 1) run, in each round and in
alternating order, two variants on an emptied table:

* **fan-out**: *parents* runs of a workflow whose first step starts *children* child runs
  in one statement (``app.start_children(job, child, items)``) and waits for all of them
  (``job.wait_for_children``); each child is a no-op step (done on return); the last child
  to finish wakes its parent (migration 0013's trigger), whose second step finishes it;
* **fan-out, one by one** (``--each``, for comparison): the same, each child started by its
  own ``app.start_run(..., parent=job)``;
* **plain**: the same number of no-op runs, queued at once, no parent.

The figure is children started, run and joined per second (from the parents' queueing to
the last parent done) against the plain runs' steps per second; the ratio is the median of
the rounds' ratios, goal >= 0.7.

    python bench/fanout_bench.py --database-url postgresql://postgres@host/postgres \\
        [--parents 20] [--children 100] [--rounds 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
from figures import Figure
from figures import print_table as print_figures
from sqlalchemy import create_engine

from outbox import App, ClaimedRun
from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate

GOAL = 0.7
PROCESSES = 4
app = App()


@app.workflow("fan-child", version="1")
def child(job: ClaimedRun[Any]) -> None:
    return None


@app.workflow("fan-parent", version="1")
def parent(job: ClaimedRun[list[Any]]) -> None:
    if job.run.step != "joined":
        count, each = job.checkpoint
        if each:
            for i in range(count):
                app.start_run(job.conn, child, idempotency_key=str(i), parent=job)
        else:
            app.start_children(job, child, {str(i): None for i in range(count)})
        job.wait_for_children("all", step="joined")


def _worker(url: str, name: str, stop: Any) -> None:
    from outbox.worker import WorkerSettings, run_worker  # noqa: PLC0415

    halt = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            time.sleep(0.05)
        halt.set()

    threading.Thread(target=watch, daemon=True).start()
    run_worker(app, settings=WorkerSettings(database_url=url, name=name, poll_seconds=1.0,
                                            log_level="WARNING"), stop=halt)


def _empty(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit.agent_runs, outboxkit.run_transitions CASCADE")


def _wait_done(url: str, workflow: str, count: int, since: float, deadline: float) -> float:
    """Seconds from *since* (the database's clock at the queueing's commit) to the last run
    of *workflow* done."""
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*), extract(epoch FROM max(finished_at)) "
                "FROM outboxkit.agent_runs WHERE workflow = %s AND state = 'done'",
                [workflow]).fetchone()
            assert row is not None
            if row[0] == count:
                return float(row[1]) - since
            time.sleep(0.1)
    raise RuntimeError(f"{workflow}: not all {count} runs done before the deadline")


_PLAIN = """
INSERT INTO outboxkit.agent_runs (id, workflow, workflow_version, state, idempotency_key)
SELECT gen_random_uuid(), 'fan-child', '1', 'queued', 'c' || g FROM generate_series(1, %s) g"""


def variant(url: str, kind: str, parents: int, children: int) -> float:
    """Runs (children, or plain runs) per second, from the queueing's commit."""
    _empty(url)
    engine = create_engine(sqlalchemy_url(url))
    spawn = mp.get_context("spawn")
    stop = spawn.Event()
    procs = [spawn.Process(target=_worker, args=(url, f"{kind}-{i}", stop))
             for i in range(PROCESSES)]
    for proc in procs:
        proc.start()
    time.sleep(3.0)  # the workers import and idle
    try:
        with engine.begin() as conn:
            if kind.startswith("fanout"):
                for p in range(parents):
                    app.start_run(conn, parent, idempotency_key=f"p{p}",
                                  checkpoint=[children, kind == "fanout-each"])
            else:
                conn.exec_driver_sql(_PLAIN, (parents * children,))
        with psycopg.connect(url) as clock:
            row = clock.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
            assert row is not None
            since = float(row[0])
        deadline = time.monotonic() + 300
        if kind.startswith("fanout"):
            seconds = _wait_done(url, "fan-parent", parents, since, deadline)
        else:
            seconds = _wait_done(url, "fan-child", parents * children, since, deadline)
        return parents * children / seconds
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOXKIT_DATABASE_URL"))
    parser.add_argument("--parents", type=int, default=20)
    parser.add_argument("--children", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--each", action="store_true",
                        help="also measure children started one statement each")
    parser.add_argument("--json", help="write the figures as JSON to this path")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("give --database-url or set OUTBOXKIT_DATABASE_URL")
    name = f"outboxkit_fanout_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.database_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    url = with_database(args.database_url, name)
    try:
        engine = create_engine(sqlalchemy_url(url))
        migrate(engine)
        engine.dispose()
        ratios, fanouts, plains, eaches = [], [], [], []
        kinds = ["fanout", "plain"] + (["fanout-each"] if args.each else [])
        for r in range(args.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            rates = {kind: variant(url, kind, args.parents, args.children) for kind in order}
            fanouts.append(rates["fanout"])
            plains.append(rates["plain"])
            ratios.append(rates["fanout"] / rates["plain"])
            each = ""
            if args.each:
                eaches.append(rates["fanout-each"])
                each = f", one by one {rates['fanout-each']:,.0f} children/s"
            print(f"round {r + 1}/{args.rounds}: fan-out {rates['fanout']:,.0f} children/s, "
                  f"plain {rates['plain']:,.0f} steps/s, ratio {ratios[-1]:.2f}{each}",
                  flush=True)
    finally:
        with psycopg.connect(args.database_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    ratio = statistics.median(ratios)
    figures = [Figure("outbox.fanout_children_per_s", statistics.median(fanouts), "children/s",
                      ceiling=statistics.median(plains), ratio=ratio, goal=f">= {GOAL}",
                      met=ratio >= GOAL)]
    if eaches:
        figures.append(Figure("outbox.fanout_children_per_s (one by one)",
                              statistics.median(eaches), "children/s",
                              ceiling=statistics.median(plains),
                              ratio=statistics.median(eaches) / statistics.median(plains)))
    print_figures(figures)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([f.as_json() for f in figures], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
