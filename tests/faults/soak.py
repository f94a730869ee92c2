"""The leak soak: the supplier-order pipeline under a steady load for MINUTES, every daemon
sampled every interval (RSS, open descriptors, threads, PostgreSQL connections) without
killing anything, and a failure if any of them grows.

    python -m tests.faults.soak --minutes 60                  # what `make soak` runs
    python -m tests.faults.soak --minutes 4 --interval-s 15   # a quick look

The rule (:mod:`tests.faults.leaks`): the first quarter of the samples is warm-up; a metric
fails when the median of the last quarter exceeds the second quarter's by more than 10 % and
by more than a small floor (2 MiB, 2 descriptors, 1 thread, 1 connection). The run also
fails if a daemon died or the pipeline's invariants failed (the fault harness's check over
every order the soak seeded: none lost, none placed twice, every run settled).

Writes ``soak-report.json`` (every sample, the verdicts, the invariants' findings; while it
runs, the samples so far with ``"partial": true``) and ``soak.svg`` (a panel per metric, a
line per daemon) at the repository root, prints the verdicts, and exits 1 on a failure.
Services and logs go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import text

from bench import plots
from tests.faults import leaks
from tests.faults.harness import Harness, ScenarioResult, Topology

ROOT = Path(__file__).resolve().parents[2]
# A test double, not a daemon of the pipeline: it keeps every order in memory (the
# invariants read them back), so its RSS grows with the load by design. Sampled, not judged.
NOT_JUDGED = ("supplier",)


class Load:
    """Orders seeded at a steady rate from a thread, a small batch each second: every
    daemon has work all the time, and the settled backlog shows whether they keep up."""

    def __init__(self, h: Harness, rate: float) -> None:
        self.h, self.rate = h, rate
        self.run_ids: list[uuid.UUID] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        due, batch = 0.0, 0
        while not self._stop.wait(1.0):
            due += self.rate  # a fractional rate carries over: 0.5/s is one order every 2 s
            count, due = int(due), due - int(due)
            if not count:
                continue
            batch += 1
            items = [f"soak-{batch}-item-{i}" for i in range(count)]
            try:
                self.run_ids += self.h.seed_orders(f"soak-{batch}", items)
            except Exception as exc:  # told in the report; the soak goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")


def backlog(h: Harness) -> dict[str, int]:
    """Runs finished, runs not final yet and messages not published yet: the open ones stay
    low when the pipeline keeps up, and the finished ones grow at the load's rate."""
    assert h.engine is not None
    with h.engine.connect() as conn:
        final, open_runs = conn.execute(text(
            "SELECT count(*) FILTER (WHERE state IN ('done', 'failed', 'needs-human')), "
            "count(*) FILTER (WHERE state NOT IN ('done', 'failed', 'needs-human')) "
            "FROM outboxkit.agent_runs")).one()
        unpublished = conn.execute(text(
            "SELECT count(*) FROM outboxkit.message_status WHERE status <> 'published'"
        )).scalar_one()
    return {"final_runs": int(final), "open_runs": int(open_runs),
            "unpublished": int(unpublished)}


def take_sample(h: Harness, pids: dict[str, int], pg_port: int, t0: float) -> dict[str, Any]:
    assert h.engine is not None
    with h.engine.connect() as conn:
        processes = leaks.sample(pids, conn, pg_port)
    load1, _, _ = os.getloadavg()
    return {"t_min": round((time.monotonic() - t0) / 60, 3), "processes": processes,
            **backlog(h), "load1": round(load1, 2)}


def series(samples: list[dict[str, Any]], names: list[str],
           metric: str) -> dict[str, list[float | None]]:
    return {n: [s["processes"].get(n, {}).get(metric) for s in samples] for n in names}


def cpu_shares(samples: list[dict[str, Any]], names: list[str]) -> dict[str, float | None]:
    """Each process's average share of one core over the run (how busy the load kept it)."""
    out: dict[str, float | None] = {}
    first, last = samples[0], samples[-1]
    minutes = last["t_min"] - first["t_min"]
    for n in names:
        a, b = first["processes"].get(n), last["processes"].get(n)
        out[n] = (round((b["cpu_s"] - a["cpu_s"]) / (minutes * 60), 3)
                  if a and b and minutes > 0 else None)
    return out


def plot(samples: list[dict[str, Any]], names: list[str], title: str,
         not_judged: tuple[str, ...] = NOT_JUDGED) -> str:
    n = len(samples)
    # To the whole second below: a sample a few milliseconds after the hour would stretch
    # the axis to the next round step (70 minutes).
    times = [math.floor(s["t_min"] * 60) / 60 for s in samples]
    marks = ([plots.Mark("2nd quarter", times[n // 4]), plots.Mark("3rd", times[n // 2]),
              plots.Mark("last quarter", times[3 * n // 4])] if n >= 4 else [])
    panels = []
    for metric in leaks.METRICS:
        lines = {name + (" (not judged)" if name in not_judged else ""):
                 [(t, v) for t, v in zip(times, values, strict=True) if v is not None]
                 for name, values in series(samples, names, metric).items()}
        panels.append(plots.line_chart(
            lines, title=f"{title}: {leaks.TITLES[metric]}", x_label="minutes",
            y_label=leaks.UNITS[metric], vlines=marks,
            note="medians of the 2nd and last quarters compared; the 1st is warm-up"))
    return plots.stack(panels)


def run(args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="outboxkit-soak-"))
    h = Harness(workdir, seed=seed, topology=Topology(args.agents, args.relays, args.consumers))
    started = datetime.now(UTC).isoformat()
    samples: list[dict[str, Any]] = []
    failures: list[str] = []
    result = ScenarioResult("soak")
    load = Load(h, args.rate)
    header = {
        "started": started, "code": code_version(), "minutes": args.minutes,
        "interval_s": args.interval_s, "rate_per_s": args.rate, "seed": seed,
        "workdir": str(workdir), "topology": vars(h.topology),
        "kafka_client": os.environ.get("OUTBOXKIT_KAFKA_CLIENT", "kafka-python"),
    }
    print(f"leak soak: {args.minutes} min, a sample every {args.interval_s:g} s, "
          f"{args.rate:g} orders/s; work dir {workdir}", flush=True)
    try:
        h.start()
        pids = {name: proc.popen.pid for name, proc in h.p.procs.items()}
        pg_port = urlsplit(h.p.database_url).port or 5432
        load.start()
        t0 = time.monotonic()
        gone: list[str] = []
        for k in range(int(args.minutes * 60 // args.interval_s) + 1):
            time.sleep(max(0.0, t0 + k * args.interval_s - time.monotonic()))
            samples.append(take_sample(h, pids, pg_port, t0))
            s = samples[-1]
            print(f"  {s['t_min']:6.1f} min: {s['final_runs']} runs finished, {s['open_runs']} "
                  f"open, {s['unpublished']} messages unpublished, load {s['load1']}",
                  flush=True)
            # The samples so far, should the run be stopped before its end.
            write_json(args.report, {**header, "partial": True, "samples": samples})
            gone = h.p.dead()
            if gone:
                failures += [f"{n} died (exit code {h.p.procs[n].popen.returncode})"
                             for n in gone]
                break  # what is left to judge is already lost: the run has failed
        load.stop()
        if not gone:
            settled = h.wait_final(load.run_ids, timeout_s=args.settle_s)
            if not settled:
                failures.append(f"the runs did not settle within {args.settle_s:g} s "
                                "after the load stopped")
            h.check(result, load.run_ids)
    except Exception as exc:
        failures.append(f"the soak could not run: {type(exc).__name__}: {exc}")
    finally:
        load.stop()
        h.stop()
    judged = [name for _, name in h.topology.names()]
    verdicts = leaks.judge_all({n: {m: series(samples, [n], m)[n] for m in leaks.METRICS}
                                for n in judged}) if samples else []
    failures += [f"{v.process} {v.metric}: {v.why}" for v in verdicts if not v.ok]
    if result.findings is not None and not result.findings.ok:
        failures += result.findings.violations
    failures += [f"seeding failed: {e}" for e in load.errors[:5]]
    names = judged + [n for n in NOT_JUDGED if samples and n in samples[0]["processes"]]
    rep = {
        **header, "orders": len(load.run_ids),
        "rule": {"growth": leaks.GROWTH, "floors": leaks.FLOORS,
                 "compare": "median of the last quarter vs median of the second"},
        "verdicts": [{**vars(v), "growth": v.growth} for v in verdicts],
        "cpu_cores": cpu_shares(samples, names) if len(samples) > 1 else {},
        "findings": result.findings.as_json() if result.findings else None,
        "failures": failures, "ok": not failures and bool(verdicts),
        "samples": samples,
    }
    write_json(args.report, rep)
    if len(samples) >= 2:
        Path(args.plot).write_text(plot(samples, names, f"{args.minutes:g}-minute soak"))
    print(table(verdicts))
    print(f"report: {args.report}; plot: {args.plot}; logs: {workdir}/logs")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return rep


def write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def code_version() -> str:
    """The commit the daemons ran (``-dirty``: with uncommitted changes in the tree)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(verdicts: list[leaks.Verdict]) -> str:
    rows = [("process", "metric", "2nd quarter", "last quarter", "growth", "ok")]
    for v in verdicts:
        rows.append((v.process, v.metric, _num(v.start), _num(v.end),
                     "-" if v.growth is None else f"{v.growth:+.1%}", "yes" if v.ok else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in rows)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x % 1 else f"{x:.0f}"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--interval-s", type=float, default=60, help="seconds between samples")
    # 5/s keeps every daemon busy all the time (agents, relays and consumers together about
    # 0.15 of a core, a 4-minute run) and far from the 2-core machine's limit: a backlog,
    # which would grow buffers and pools for its own reason, does not build up.
    p.add_argument("--rate", type=float, default=5, help="orders seeded per second")
    p.add_argument("--settle-s", type=float, default=180,
                   help="how long the runs may take to finish once the load stops")
    p.add_argument("--seed", type=int)
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--report", default=str(ROOT / "soak-report.json"))
    p.add_argument("--plot", default=str(ROOT / "soak.svg"))
    p.add_argument("--workdir", help="where services and logs go (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return 0 if run(parse(argv))["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
