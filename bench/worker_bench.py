"""What the agent worker costs a step, and how fast it wakes up (issue 28).

``outbox.worker_steps_per_s``: *N* runs queued beforehand (one ``INSERT ... SELECT
generate_series``), drained by 4 processes each running ``outbox.worker.run_worker`` on an
app with one no-op step function (it saves a checkpoint and moves the run to ``done``);
against the same loop in raw psycopg, 4 processes, with the same commits per step: the claim
(``FOR UPDATE SKIP LOCKED`` on the queued runs' index, the lease columns, its history row)
committed at once, then the fenced checkpoint UPDATE and the fenced move to ``done`` with its
history row, committed together. The rate is the steady state: the runs finished between the
10th and the 90th percentile of ``finished_at``, over that time (process start-up and the
drain's tail are not counted). Both variants run in each round, order alternating, on the
same table (emptied between); the figure's ratio is the median of the per-round ratios,
goal >= 0.7. CPU per step of each variant's processes (``time.process_time``, imports
excluded) is reported beside it.

``outbox.worker_wakeup_p50_ms`` / ``_p99_ms``: one idle worker (``poll_seconds`` 60, so a
NOTIFY, not the poll, wakes it); this process starts runs at 100 a second (``App.start_run``
and COMMIT); a run's latency is from the moment its COMMIT returned here to the moment its
step function started in the worker (``time.time()`` stored in the checkpoint; one machine,
one clock). Goals: p50 <= 10 ms, p99 <= 50 ms.

    python bench/worker_bench.py --database-url postgresql://postgres@host/postgres \\
        [--quick] [--json results.json] [--runs N] [--rounds R] [--concurrency C]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from durable import make_durable, show  # bench/durable.py (this folder is on sys.path)
from figures import Figure
from figures import print_table as print_figures
from psycopg.types.json import Jsonb

from outbox import App, ClaimedRun
from outbox.runs.states import RunState

STEPS_GOAL = 0.7
P50_GOAL_MS = 10.0
P99_GOAL_MS = 50.0
NOOP = "bench-noop"
WAKE = "bench-wake"

app = App()


@app.workflow(NOOP, version="1")
def noop(job: ClaimedRun[Any]) -> None:
    """The measured step: a checkpoint and the move to done, nothing else."""
    job.save_checkpoint({"n": 1}, step="s1")
    job.transition(RunState.DONE, reason="bench", evidence={"bench": True})


@app.workflow(WAKE, version="1")
def wake(job: ClaimedRun[Any]) -> None:
    """Records when it started (the run then goes to done as the step returned)."""
    job.save_checkpoint({"started": time.time()})


# --- the raw SQL loop ---------------------------------------------------------------------

_RAW_CLAIM = """
WITH candidate AS (
    SELECT id FROM outboxkit.agent_runs
     WHERE state = 'queued' AND not_before IS NULL AND purged_at IS NULL
     ORDER BY created_at LIMIT 1
       FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE outboxkit.agent_runs r
       SET state = 'running', lease_owner = %(worker)s, lease_token = r.lease_token + 1,
           lease_expires_at = now() + interval '60 seconds', version = r.version + 1,
           not_before = NULL, updated_at = now()
      FROM candidate WHERE r.id = candidate.id
    RETURNING r.id, r.lease_token, r.version, r.step, r.checkpoint
), hist AS (
    INSERT INTO outboxkit.run_transitions
        (run_id, from_state, to_state, step, reason, actor, lease_token)
    SELECT id, 'queued', 'running', step, %(reason)s, %(worker)s, lease_token FROM claimed
)
SELECT id, lease_token, version, checkpoint FROM claimed"""

_RAW_SAVE = """
UPDATE outboxkit.agent_runs
   SET checkpoint = %s, step = %s, version = version + 1, updated_at = now()
 WHERE id = %s AND lease_token = %s AND version = %s AND state = 'running'
   AND purged_at IS NULL
RETURNING version"""

_RAW_DONE = """
WITH moved AS (
    UPDATE outboxkit.agent_runs
       SET state = 'done', reason = %(reason)s, last_evidence = %(evidence)s,
           lease_owner = NULL, lease_expires_at = NULL, version = version + 1,
           updated_at = now(), finished_at = now()
     WHERE id = %(id)s AND lease_token = %(token)s AND version = %(version)s
       AND state = 'running' AND purged_at IS NULL
    RETURNING id, step, lease_token, version
), hist AS (
    INSERT INTO outboxkit.run_transitions
        (run_id, from_state, to_state, step, reason, evidence, actor, lease_token)
    SELECT id, 'running', 'done', step, %(reason)s, %(evidence)s, %(worker)s, lease_token
      FROM moved
)
SELECT version FROM moved"""


def _raw_loop(url: str, name: str) -> int:
    """Claim, checkpoint, move to done, until nothing is left to claim; the steps done."""
    steps = 0
    evidence = Jsonb({"bench": True})
    with psycopg.connect(url) as conn:
        while True:
            row = conn.execute(_RAW_CLAIM, {"worker": name,
                                            "reason": f"claimed by {name}"}).fetchone()
            conn.commit()
            if row is None:
                return steps
            run_id, token, version, _checkpoint = row
            saved = conn.execute(_RAW_SAVE, [Jsonb({"n": 1}), "s1", run_id, token, version]
                                 ).fetchone()
            assert saved is not None, "lease lost"
            done = conn.execute(_RAW_DONE, {"reason": "bench", "evidence": evidence,
                                            "id": run_id, "token": token, "version": saved[0],
                                            "worker": name}).fetchone()
            assert done is not None, "lease lost"
            conn.commit()
            steps += 1


# --- child processes ------------------------------------------------------------------------


def _child(kind: str, url: str, name: str, *, concurrency: int, poll_seconds: float,
           stop: Any, deadline: float, results: Any, profile: str | None) -> None:
    """One process of a variant: the worker until *stop* is set (or *deadline*, a bound),
    or the raw loop until the queue is empty. Reports its CPU seconds (imports excluded)."""
    from outbox.worker import WorkerSettings, run_worker  # noqa: PLC0415

    profiler = step_profiler = None
    if profile:
        import cProfile  # noqa: PLC0415

        from outbox.worker import steps  # noqa: PLC0415

        # CPU time per thread (wall time on a loaded machine would count waiting): the loop
        # thread (claims) here, the step threads' run_sync calls into their own profile.
        profiler = cProfile.Profile(time.thread_time)
        step_profiler = cProfile.Profile(time.thread_time)
        run_sync = steps.run_sync

        def profiled(*a: Any, **k: Any) -> Any:
            assert step_profiler is not None
            return step_profiler.runcall(run_sync, *a, **k)

        steps.run_sync = profiled  # type: ignore[assignment]
        profiler.enable()
    cpu = time.process_time()
    try:
        if kind == "raw":
            _raw_loop(url, name)
        else:
            settings = WorkerSettings(database_url=url, name=name, concurrency=concurrency,
                                      poll_seconds=poll_seconds, lease_seconds=60,
                                      log_level="WARNING")
            halt = threading.Event()

            def watch() -> None:
                end = time.monotonic() + deadline
                # is_set and a sleep, not stop.wait: a process that died while waiting on a
                # multiprocessing Event would leave the parent's set() waiting for it forever.
                while not stop.is_set() and time.monotonic() < end:
                    time.sleep(0.05)
                halt.set()

            threading.Thread(target=watch, daemon=True).start()
            code = run_worker(app, settings=settings, stop=halt)
            assert code == 0, f"worker exited with {code}"
        results.put(("ok", name, time.process_time() - cpu))
    except BaseException as exc:  # reported to the parent, which stops the benchmark
        results.put(("error", name, repr(exc)))
    finally:
        if profiler is not None and step_profiler is not None and profile:
            profiler.disable()
            profiler.dump_stats(profile)
            step_profiler.dump_stats(f"{profile}.steps")


class Variant:
    """*processes* children of one kind, started together, stopped by themselves."""

    def __init__(self, kind: str, url: str, processes: int, *, concurrency: int,
                 poll_seconds: float, deadline: float, profile: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.stop = ctx.Event()
        self.procs = [
            ctx.Process(target=_child, daemon=True, args=(kind, url, f"bench-{kind}-{i}"),
                        kwargs={"concurrency": concurrency, "poll_seconds": poll_seconds,
                                "stop": self.stop, "deadline": deadline,
                                "results": self.results,
                                "profile": profile if i == 0 else None})
            for i in range(processes)
        ]
        self.deadline = deadline
        for proc in self.procs:
            proc.start()

    def finish(self) -> list[float]:
        """Stop the children (the worker's stop event), collect each one's CPU seconds."""
        self.stop.set()
        cpu: list[float] = []
        end = time.monotonic() + self.deadline + 30
        try:
            while len(cpu) < len(self.procs):
                try:
                    status, name, value = self.results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > end:
                        raise RuntimeError(f"a child died (exit codes {dead}) or the drain "
                                           "outlasted its deadline") from None
                    continue
                if status != "ok":
                    raise RuntimeError(f"{name} failed: {value}")
                cpu.append(value)
        finally:
            for proc in self.procs:
                proc.join(timeout=10)
                if proc.is_alive():  # ours, by its own handle
                    proc.kill()
                    proc.join(timeout=5)
        return cpu


# --- the throughput rounds ------------------------------------------------------------------

_QUEUE = """
INSERT INTO outboxkit.agent_runs
    (id, workflow, workflow_version, state, idempotency_key, checkpoint, created_at)
SELECT gen_random_uuid(), %s, '1', 'queued', 'run-' || g, '{"n": 0}'::jsonb,
       now() - interval '1 hour' + g * interval '1 microsecond'
FROM generate_series(1, %s) AS g"""


def queue_runs(url: str, runs: int) -> None:
    """An empty table (and history), then *runs* queued runs of the no-op workflow."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit.agent_runs, outboxkit.run_transitions, "
                     "outboxkit.run_log CASCADE")
        conn.execute(_QUEUE, [NOOP, runs])
        conn.execute("VACUUM ANALYZE outboxkit.agent_runs")
        conn.execute("VACUUM ANALYZE outboxkit.run_transitions")


def steady_rate(url: str, runs: int) -> float:
    """Runs finished between the 10th and 90th percentile of finished_at, per second."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*), percentile_disc(0.1) WITHIN GROUP (ORDER BY finished_at), "
            "percentile_disc(0.9) WITHIN GROUP (ORDER BY finished_at) "
            "FROM outboxkit.agent_runs WHERE state = 'done'").fetchone()
    assert row is not None
    done, low, high = row
    if done != runs:
        raise RuntimeError(f"{done} of {runs} runs done")
    return 0.8 * runs / max((high - low).total_seconds(), 1e-6)


def drain(url: str, runs: int, kind: str, *, processes: int, concurrency: int,
          deadline: float, profile: str | None = None) -> tuple[float, float]:
    """(steady steps/s, CPU microseconds per step of the variant's processes)."""
    queue_runs(url, runs)
    variant = Variant(kind, url, processes, concurrency=concurrency, poll_seconds=60.0,
                      deadline=deadline, profile=profile)
    if kind != "raw":  # the raw loop stops when the queue is empty; the worker idles
        end = time.monotonic() + deadline
        with psycopg.connect(url, autocommit=True) as conn:
            while time.monotonic() < end:
                row = conn.execute("SELECT count(*) FROM outboxkit.agent_runs "
                                   "WHERE state <> 'done'").fetchone()
                if row is not None and row[0] == 0:
                    break
                time.sleep(0.2)
    cpu = variant.finish()
    return steady_rate(url, runs), sum(cpu) / runs * 1e6


def throughput_rounds(url: str, *, runs: int, rounds: int, processes: int, concurrency: int,
                      deadline: float) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"worker": [], "raw": [], "worker_cpu_us": [],
                                       "raw_cpu_us": [], "loadavg": []}
    for round_no in range(rounds):
        order = ("worker", "raw") if round_no % 2 == 0 else ("raw", "worker")
        for kind in order:
            rate, cpu_us = drain(url, runs, kind, processes=processes,
                                 concurrency=concurrency, deadline=deadline)
            samples[kind].append(rate)
            samples[f"{kind}_cpu_us"].append(cpu_us)
        samples["loadavg"].append(os.getloadavg()[0])
        print(f"round {round_no + 1}/{rounds}: worker {samples['worker'][-1]:,.0f} steps/s "
              f"({samples['worker_cpu_us'][-1]:,.0f} us CPU/step), raw SQL "
              f"{samples['raw'][-1]:,.0f} steps/s ({samples['raw_cpu_us'][-1]:,.0f} us), "
              f"ratio {samples['worker'][-1] / samples['raw'][-1]:.2f}, load "
              f"{samples['loadavg'][-1]:.1f}", flush=True)
    return samples


# --- wake-up latency ------------------------------------------------------------------------


def wakeup_latencies(url: str, *, rate: float, seconds: float, deadline: float) -> list[float]:
    """Milliseconds from each start_run's COMMIT returning here to its step starting."""
    from sqlalchemy import create_engine  # noqa: PLC0415

    from outbox.db.dsn import sqlalchemy_url  # noqa: PLC0415

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit.agent_runs, outboxkit.run_transitions, "
                     "outboxkit.run_log CASCADE")
    variant = Variant("worker", url, 1, concurrency=4, poll_seconds=60.0, deadline=deadline)
    engine = create_engine(sqlalchemy_url(url), pool_size=1)
    committed: dict[str, float] = {}
    count = int(rate * seconds)
    try:
        with engine.connect() as conn:
            # Until the worker listens: a first run, waited for (it also warms both sides).
            for n in range(3):
                app.start_run(conn, wake, idempotency_key=f"warm-{n}", checkpoint={})
                conn.commit()
                _wait_done(conn, f"warm-{n}", deadline)
            period = 1.0 / rate
            start = time.monotonic()
            for n in range(count):
                time.sleep(max(0.0, start + n * period - time.monotonic()))
                app.start_run(conn, wake, idempotency_key=f"wake-{n}", checkpoint={})
                conn.commit()
                committed[f"wake-{n}"] = time.time()
            # Every run, not only the last started: steps run 4 at a time, in any order.
            _wait_all_done(conn, "wake-%", count, deadline)
            from sqlalchemy import text  # noqa: PLC0415

            rows = conn.execute(text(
                "SELECT idempotency_key, (checkpoint->>'started')::float8, state "
                "FROM outboxkit.agent_runs WHERE idempotency_key LIKE 'wake-%'")).all()
            conn.rollback()
    finally:
        engine.dispose()
        variant.finish()
    if len(rows) != count or any(state != "done" for _, _, state in rows):
        raise RuntimeError(f"{sum(s == 'done' for _, _, s in rows)} of {count} runs done")
    return [(started - committed[key]) * 1000 for key, started, _ in rows]


def _wait_done(conn: Any, key: str, deadline: float) -> None:
    from sqlalchemy import text  # noqa: PLC0415

    end = time.monotonic() + deadline
    while time.monotonic() < end:
        state = conn.execute(text("SELECT state FROM outboxkit.agent_runs "
                                  "WHERE idempotency_key = :k"), {"k": key}).scalar()
        conn.rollback()
        if state == "done":
            return
        time.sleep(0.01)
    raise RuntimeError(f"run {key} not done within {deadline:.0f} s")


def _wait_all_done(conn: Any, pattern: str, count: int, deadline: float) -> None:
    from sqlalchemy import text  # noqa: PLC0415

    end = time.monotonic() + deadline
    done = 0
    while time.monotonic() < end:
        done = conn.execute(text("SELECT count(*) FROM outboxkit.agent_runs WHERE state = 'done' "
                                 "AND idempotency_key LIKE :p"), {"p": pattern}).scalar()
        conn.rollback()
        if done >= count:
            return
        time.sleep(0.01)
    raise RuntimeError(f"{done} of {count} runs done within {deadline:.0f} s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --- main ----------------------------------------------------------------------------------


def figures_of(samples: dict[str, list[float]], latencies: list[float], *, judged: bool,
               runs: int, processes: int, concurrency: int, rate: float) -> list[Figure]:
    worker, raw = samples["worker"], samples["raw"]
    ratios = [w / r for w, r in zip(worker, raw, strict=True)]
    ratio = statistics.median(ratios)
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    shape = (f"{processes} processes, {runs:,} queued runs, concurrency {concurrency}, "
             f"median of {len(worker)} rounds")
    return [
        Figure("outbox.worker_steps_per_s", statistics.median(worker), "steps/s",
               statistics.median(raw), ratio, f"≥ {STEPS_GOAL}",
               ratio >= STEPS_GOAL if judged else None,
               note=f"{shape}; ceiling = the same claim/checkpoint/done loop in raw psycopg; "
               f"ratio = median of per-round ratios {[round(r, 2) for r in ratios]}"),
        Figure("outbox.worker_cpu_us_per_step", statistics.median(samples["worker_cpu_us"]),
               "us", statistics.median(samples["raw_cpu_us"]),
               statistics.median(samples["worker_cpu_us"])
               / statistics.median(samples["raw_cpu_us"]),
               note="CPU of the worker processes per step (imports excluded); ceiling "
               "column = the raw loop's"),
        Figure("outbox.worker_wakeup_p50_ms", p50, "ms", goal=f"≤ {P50_GOAL_MS:g}",
               met=p50 <= P50_GOAL_MS if judged else None,
               note=f"committed start_run to the step function starting, {len(latencies)} "
               f"runs started at {rate:g}/s by another process, one idle worker "
               "(poll_seconds 60: NOTIFY)"),
        Figure("outbox.worker_wakeup_p99_ms", p99, "ms", goal=f"≤ {P99_GOAL_MS:g}",
               met=p99 <= P99_GOAL_MS if judged else None,
               note=f"as p50; max {max(latencies):.1f} ms"),
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOXKIT_DATABASE_URL"))
    parser.add_argument("--json", help="write the figures as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="a smoke run (small sizes)")
    parser.add_argument("--runs", type=int, help="queued runs per drain (default 20,000; "
                        "1,500 with --quick)")
    parser.add_argument("--rounds", type=int, help="rounds (default 3; 1 with --quick)")
    parser.add_argument("--processes", type=int, default=4, help="processes per variant")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="the workers' concurrency (steps in flight per process)")
    parser.add_argument("--wakeup-seconds", type=float,
                        help="seconds of runs started at --wakeup-rate (default 10; 2 quick)")
    parser.add_argument("--wakeup-rate", type=float, default=100.0, help="runs started/s")
    parser.add_argument("--profile", help="cProfile one worker process of one drain into "
                        "this file (and measure nothing else)")
    parser.add_argument("--allow-not-durable", action="store_true",
                        help="leave the server's durability as it is (a smoke run on a test "
                        "server)")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("give --database-url or set OUTBOXKIT_DATABASE_URL")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    runs = args.runs or (1_500 if args.quick else 20_000)
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.wakeup_seconds or (2.0 if args.quick else 10.0)
    deadline = 60.0 + runs / 100  # a bound: no drain of this size takes 100 runs/s

    from outbox_steps import create_database, drop_database  # noqa: PLC0415
    from sqlalchemy import create_engine  # noqa: PLC0415

    from outbox.db.dsn import sqlalchemy_url  # noqa: PLC0415
    from outbox.db.migrate import migrate  # noqa: PLC0415

    restore: Callable[[], None]
    durability, restore = (
        ("not checked (--allow-not-durable)", lambda: None) if args.allow_not_durable
        else make_durable(args.database_url))
    name, url = create_database(args.database_url)
    try:
        engine = create_engine(sqlalchemy_url(url))
        try:
            migrate(engine)
        finally:
            engine.dispose()
        print(f"database {name} | durability: {durability} | fsync={show(url)['fsync']} | "
              f"cores {os.cpu_count()} | load {os.getloadavg()[0]:.1f}", flush=True)
        if args.profile:
            rate, cpu_us = drain(url, runs, "worker", processes=args.processes,
                                 concurrency=args.concurrency, deadline=deadline,
                                 profile=args.profile)
            print(f"profiled: {rate:,.0f} steps/s, {cpu_us:,.0f} us CPU/step; "
                  f"stats in {args.profile}")
            return 0
        samples = throughput_rounds(url, runs=runs, rounds=rounds, processes=args.processes,
                                    concurrency=args.concurrency, deadline=deadline)
        latencies = wakeup_latencies(url, rate=args.wakeup_rate, seconds=seconds,
                                     deadline=deadline)
        print(f"wake-up: p50 {percentile(latencies, 0.5):.1f} ms, p99 "
              f"{percentile(latencies, 0.99):.1f} ms, max {max(latencies):.1f} ms "
              f"({len(latencies)} runs), load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        with contextlib.suppress(Exception):
            drop_database(args.database_url, name)
        restore()
    figures = figures_of(samples, latencies, judged=not args.allow_not_durable, runs=runs,
                         processes=args.processes, concurrency=args.concurrency,
                         rate=args.wakeup_rate)
    print()
    print_figures(figures)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"durability": durability, "runs": runs, "rounds": rounds,
                       "processes": args.processes, "concurrency": args.concurrency,
                       "cores": os.cpu_count(), "python": sys.version.split()[0],
                       "samples": samples, "wakeup_ms": latencies,
                       "figures": [f.as_json() for f in figures]}, out, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
