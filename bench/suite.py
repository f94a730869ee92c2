"""The benchmark suite: the eight benchmarks in one run, one table, one JSON file, two plots.

Runs bench/outbox_steps.py (what an outbox message costs an agent step), bench/run_claim.py
(what a run claim costs with 1,000,000 queued runs against 10,000), bench/agent_steps.py
(what durability costs a pydantic-ai agent step), bench/relay_bench.py
(relay throughput against the producer alone and against reading plus sending, commit-to-Kafka
latency, PostgreSQL CPU and dead tuples per message, idle cost, backlog cost, memory),
bench/consumer_bench.py (idempotent consumer against kafka-python's consumer alone),
bench/keyed_bench.py (per-message mode: keys at the same time, a failing key's isolation) and
bench/worker_bench.py (the agent worker's steps/s against the same loop in raw SQL, its
NOTIFY wake-up latency) and bench/console_bench.py (the operator console's pages with
1,000,000 runs and outbox rows), one after the other, each as its own process, against the same
services: a throwaway PostgreSQL and Kafka started once for the suite, or the ones given
with --database-url and --kafka-bootstrap. The server is made durable (fsync,
synchronous_commit, full_page_writes) once for the whole suite and restored at the end.

Writes ``{"machine", "started", "figures"}`` to bench/results/latest.json (or --json), and
latency.svg / throughput.svg to bench/results (or --out-dir).

    .venv/bin/python bench/suite.py [--quick] [--json PATH] [--out-dir DIR] \\
        [--database-url URL --kafka-bootstrap HOST:PORT]

--quick is a smoke run (small sizes, about a minute): it checks that everything runs, judges
no goal and leaves the server's durability settings as they are (a test server may run with
fsync=off).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import plots  # bench/plots.py (this folder is on sys.path)
from durable import make_durable, show  # bench/durable.py
from figures import Figure, print_table  # bench/figures.py
from relay_bench import machine_info, services  # the relay bench knows how to start services

from outbox.db.dsn import redact

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

REQUIRED = (
    "outbox.step_emit_ratio",
    "outbox.raw_sql_ratio",
    "outbox.claim_backlog_ratio",
    "agents.step_overhead_ms",
    "relay.throughput_msgs_per_s",
    "relay.throughput_ratio",
    "relay.latency_p50_ms",
    "relay.latency_p99_ms",
    "relay.latency_p99_ms_polling",
    "relay.claim_backlog_ratio",
    "relay.peak_rss_mb",
    "relay.read_ceiling_msgs_per_s",
    "relay.bound_ratio",
    "relay.pg_cpu_us_per_msg",
    "relay.dead_tuples_per_msg",
    "relay.idle_cores_200",
    "relay.latency_p99_ms_200",
    "consumer.batch_msgs_per_s",
    "consumer.batch_ratio",
    "consumer.retry_isolation_ratio",
    "consumer.per_message_msgs_per_s",
    "consumer.io_bound_msgs_per_s",
    "consumer.key_isolation_ratio",
    "consumer.keyed_rss_ratio",
    "outbox.worker_steps_per_s",
    "outbox.worker_wakeup_p50_ms",
    "outbox.worker_wakeup_p99_ms",
    "console.page_ms_1m",
)

# Smoke sizes: every phase runs, briefly (the benches' own --quick is still minutes long),
# with the default Kafka client only (`make bench` measures both).
QUICK_ARGS = {
    "outbox_steps": [
        "--quick", "--seconds", "0.2", "--rounds", "1", "--clients", "4", "--no-threads",
    ],
    "run_claim": ["--quick", "--small", "2000", "--rounds", "1", "--claims", "10"],
    "agent_steps": ["--quick", "--rounds", "2", "--runs", "4"],
    "relay_bench": [
        "--quick", "--clients", "kafka-python", "--n", "2000", "--latency-seconds", "2",
        "--low-seconds", "0", "--writers", "2", "--claim-backlog", "8000", "--rss-backlog", "8000",
        # Neither the light-traffic phase nor the variants of (b) gives a figure the smoke
        # run needs; each is a relay process of its own (about 6 s).
        "--idle-seconds", "0", "--no-variants",
    ],
    "consumer_bench": [
        "--quick", "--clients", "kafka-python", "--n", "2000", "--n-isolation", "300",
    ],
    "keyed_bench": ["--quick", "--clients", "kafka-python", "--n", "600", "--n-isolation",
                    "300", "--keys-small", "300", "--keys-large", "900"],
    "worker_bench": ["--quick", "--runs", "600", "--processes", "2", "--wakeup-seconds", "1"],
    "console_bench": ["--quick", "--runs", "5000", "--requests", "2", "--live-seconds", "1.5"],
}


def log(message: str) -> None:
    print(f"[suite {datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes, no verdicts")
    p.add_argument("--json", default=str(RESULTS / "latest.json"), help="where the JSON goes")
    p.add_argument("--out-dir", default=str(RESULTS), help="where the SVG plots go")
    p.add_argument("--database-url", help="an existing PostgreSQL server (admin URL)")
    p.add_argument("--kafka-bootstrap", help="an existing Kafka broker host:port")
    p.add_argument("--state-dir", help="where throwaway services live (kept if given)")
    return p.parse_args(argv)


def run_bench(name: str, argv: list[str]) -> float:
    """Run bench/<name>.py in its own process; its wall seconds. Ctrl-C lets it clean up."""
    log(f"{name} {' '.join(redact(a) if '://' in a else a for a in argv)}")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(HERE / f"{name}.py"), *argv], cwd=HERE.parent)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.wait()  # it got the SIGINT too: let it drop its database and stop its relays
        raise
    if code != 0:
        raise SystemExit(f"bench/{name}.py failed with exit code {code}; nothing written")
    return time.monotonic() - started


def kafka_version(bootstrap: str) -> str:
    """The broker's version as kafka-python infers it from the API versions it offers."""
    from kafka import KafkaAdminClient  # noqa: PLC0415

    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
    try:
        broker = admin.describe_cluster()["brokers"][0]["broker_id"]
        version = admin.get_broker_version_data(broker).broker_version_str
        return f"{version} (from its API versions)"
    except Exception as exc:  # a version we cannot tell does not stop the run
        return f"unknown ({exc})"
    finally:
        admin.close()


# --- mapping the benches' output to the suite's figures -----------------------------------


def step_figures(rows: list[dict[str, Any]]) -> list[Figure]:
    """outbox_steps writes rows (path, mode, clients, plain and +message steps/s, ratio)."""
    figures = []
    for row in rows:
        suffix = "_threads" if row["mode"] == "threads" else ""
        figures.append(
            Figure(
                f"outbox.steps_per_s_{row['path'].replace('-', '_')}{suffix}_{row['clients']}",
                row["steps_per_s_with_message"],
                "steps/s",
                row["steps_per_s_plain"],
                row["ratio"],
                note="steps with one message emitted; ceiling = the same steps without",
            )
        )
    processes = [r for r in rows if r["mode"] == "processes"]
    ours = min((r for r in processes if r["path"] != "raw-sql"), key=lambda r: r["ratio"])
    raw = min((r for r in processes if r["path"] == "raw-sql"), key=lambda r: r["ratio"])
    figures.insert(
        0,
        Figure(
            "outbox.step_emit_ratio",
            ours["ratio"],
            "ratio",
            ours["steps_per_s_plain"],
            ours["ratio"],
            "≥ 0.8",
            ours["ratio"] >= 0.8,
            note=f"lowest of sync/async over worker counts: {ours['path']}, "
            f"{ours['clients']} workers; ceiling = steps/s without the message",
        ),
    )
    figures.insert(
        1,
        Figure(
            "outbox.raw_sql_ratio",
            raw["ratio"],
            "ratio",
            raw["steps_per_s_plain"],
            raw["ratio"],
            note=f"plain psycopg UPDATE + INSERT vs UPDATE (what any outbox costs), "
            f"lowest over worker counts: {raw['clients']} workers",
        ),
    )
    return figures


def figure_of(data: dict[str, Any]) -> Figure:
    def number(x: Any) -> float | None:
        return None if x is None else float(x)

    return Figure(
        data["name"],
        math.nan if data["value"] is None else float(data["value"]),
        data["unit"],
        number(data.get("ceiling")),
        number(data.get("ratio")),
        data.get("goal"),
        data.get("met"),
        data.get("note", ""),
    )


def collect(work: Path) -> list[Figure]:
    steps = json.loads((work / "outbox_steps.json").read_text())
    figures = step_figures(steps["rows"]) + [figure_of(f) for f in steps.get("figures", [])]
    for name in ("run_claim", "agent_steps", "relay_bench", "consumer_bench", "keyed_bench",
                 "worker_bench", "console_bench"):
        document = json.loads((work / f"{name}.json").read_text())
        figures += [figure_of(f) for f in document["figures"]]
    return figures


# --- plots ---------------------------------------------------------------------------------


def write_plots(samples: dict[str, Any], figures: dict[str, Figure], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    latencies = samples["latency_ms"]["notify"]
    p50, p99 = figures["relay.latency_p50_ms"].value, figures["relay.latency_p99_ms"].value
    load = figures["relay.latency_load_msgs_per_s"].value
    # A few stray seconds-long outliers would squash the histogram into one bar: clip them
    # (and say so in the plot) when the tail runs far beyond p99.
    clip = 3 * p99 if latencies and max(latencies) > 5 * p99 else None
    (out_dir / "latency.svg").write_text(
        plots.histogram(
            latencies,
            title=f"Relay latency, commit to Kafka append (NOTIFY, {load:,.0f} msgs/s)",
            x_label="milliseconds from COMMIT to the broker's append",
            marks=[plots.Mark(f"p50 {p50:.1f} ms", p50), plots.Mark(f"p99 {p99:.1f} ms", p99)],
            clip_above=clip,
        )
    )
    # The round with the median drain time stands for the run.
    drains = sorted(samples["drains"], key=lambda d: d["from_start_s"])
    drain = drains[len(drains) // 2]
    ceiling = samples["producer_alone_msgs_per_s"]
    (out_dir / "throughput.svg").write_text(
        plots.throughput(
            [(t, n) for t, n in drain["timeline"]],
            title=f"Relay draining {drain['rows']:,} rows (time from process spawn)",
            end_s=drain["from_start_s"],
            reference=plots.Mark(f"producer alone {ceiling:,.0f} msgs/s", ceiling),
        )
    )


# --- the run ---------------------------------------------------------------------------------


def durable_or_not(admin_url: str, quick: bool) -> tuple[str, Callable[[], None], bool]:
    """(what durability is, how to restore it, whether the benches must leave it alone).

    A quick run judges nothing, so it leaves the server as it is: changing the settings of
    what may be a shared test server would buy nothing.
    """
    if quick:
        shown = ", ".join(f"{k}={v}" for k, v in show(admin_url).items())
        return f"left as it is (quick run): {shown}", lambda: None, True
    durability, restore = make_durable(admin_url)
    return durability, restore, False


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = datetime.now(UTC)
    with (
        tempfile.TemporaryDirectory(prefix="outboxkit-suite-") as tmp,
        services(args) as (admin_url, bootstrap),
    ):
        work = Path(tmp)
        machine = machine_info(admin_url, bootstrap)
        machine["kafka"] = kafka_version(bootstrap)
        durability, restore, not_durable = durable_or_not(admin_url, args.quick)
        machine["durability"] = durability
        common = ["--database-url", admin_url] + (["--allow-not-durable"] if not_durable else [])
        kafka = ["--kafka-bootstrap", bootstrap]
        plan = {
            "outbox_steps": common,
            "run_claim": common,
            "agent_steps": common,
            "relay_bench": [*common, *kafka, "--samples", str(work / "samples.json")],
            "consumer_bench": [*common, *kafka],
            "keyed_bench": [*common, *kafka],
            "worker_bench": common,
            "console_bench": common,
        }
        seconds = {}
        try:
            for name, bench_args in plan.items():
                extra = QUICK_ARGS[name] if args.quick else []
                out = ["--json", str(work / f"{name}.json")]
                seconds[name] = round(run_bench(name, [*bench_args, *extra, *out]), 1)
        finally:
            restore()
        figures = collect(work)
        samples = json.loads((work / "samples.json").read_text())
    machine |= {
        "loadavg_end": os.getloadavg(),
        "mode": "quick" if args.quick else "full",
        "bench_seconds": seconds,
    }
    by_name = {f.name: f for f in figures}
    missing = [name for name in REQUIRED if name not in by_name]
    if missing:
        raise SystemExit(f"the benches did not report {', '.join(missing)}; nothing written")
    if args.quick:
        for figure in figures:  # smoke sizes on a busy machine: no verdicts
            figure.met = None

    print()
    print_table(figures)
    judged = [f for f in figures if f.met is not None]
    if args.quick:
        print("\nquick run: a smoke test of the suite; no goal is judged")
    else:
        print(f"\ngoals met: {sum(bool(f.met) for f in judged)} of {len(judged)}")
    document = {
        "machine": machine,
        "started": started.isoformat(),
        "figures": [f.as_json() for f in figures],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    write_plots(samples, by_name, Path(args.out_dir))
    print(f"written: {args.json}, {Path(args.out_dir) / 'latency.svg'}, "
          f"{Path(args.out_dir) / 'throughput.svg'}")
    print(f"suite took {(datetime.now(UTC) - started).total_seconds():.0f} s "
          f"({', '.join(f'{k} {v:g} s' for k, v in seconds.items())})")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
    raise SystemExit(130)
