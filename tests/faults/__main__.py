"""The fault harness from the command line.

    python -m tests.faults                      # the CI subset, a random seed
    python -m tests.faults --seed 42            # replay a run
    python -m tests.faults --full               # every scenario, longer outages
    python -m tests.faults --soak 30            # scenarios looped 30 min (make faults-soak)
    python -m tests.faults --cluster --rounds 3 # production's topology: 3 Kafka nodes, a
                                                # PostgreSQL primary + synchronous standby
    python -m tests.faults --network            # network faults through Toxiproxy: partitions,
                                                # latency, half-open connections, fencing

Ends with the table, writes ``faults-report.json`` (``faults-report-cluster.json`` with
``--cluster``, ``faults-report-network.json`` with ``--network``) at the repository root,
and exits 1 when any invariant failed (printing the seed and the command that replays it).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.faults import (
    cluster_scenarios,
    consumer_kills,
    network_scenarios,
    runner,
    saga,
    scenarios,
)
from tests.faults.harness import Harness, ScenarioResult, Topology

ROOT = Path(__file__).resolve().parents[2]


def pick(args: argparse.Namespace, rng: random.Random) -> list[scenarios.Scenario]:
    outage = rng.uniform(20, 60) if args.full or args.soak else args.outage
    if args.network:
        chosen = network_scenarios.network_set(network_scenarios.Lengths(
            partition_s=args.partition_s, slow_s=args.partition_s,
            half_open_s=args.half_open_s))
    elif args.cluster:
        chosen = cluster_scenarios.cluster_set()
    elif args.soak:
        chosen = [*scenarios.full(outage, kill_rounds=25), saga.saga_kills(25),
                  consumer_kills.consumer_kills(10)]
    elif args.full:
        chosen = [*scenarios.full(outage), saga.saga_kills(), consumer_kills.consumer_kills(5)]
    else:  # the CI subset (consumer-kills is CI's), and the saga's (its e2e test is CI's)
        chosen = [*scenarios.ci_subset(outage), consumer_kills.consumer_kills(),
                  saga.saga_kills()]
    if args.scenarios:
        wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in {s.name for s in chosen}]
        if unknown:
            sys.exit(f"unknown scenario(s): {', '.join(unknown)}; known: "
                     f"{', '.join(s.name for s in chosen)}")
        chosen = [s for s in chosen if s.name in wanted]
    return chosen


def run(args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="outboxkit-faults-"))
    h = Harness(workdir, seed=seed, topology=Topology(args.agents, args.relays, args.consumers),
                orders=args.orders, cluster=args.cluster, proxied=args.network)
    started, t0 = datetime.now(UTC).isoformat(), time.monotonic()
    results: list[ScenarioResult] = []
    print(f"fault harness: seed {seed}, work dir {workdir}"
          f"{' (cluster)' if args.cluster else ''}{' (network)' if args.network else ''}",
          flush=True)
    try:
        h.start()  # inside the try: a start that fails halfway still stops what it started
        deadline = t0 + args.soak * 60 if args.soak else None
        rounds = 0
        while True:
            rounds += 1
            for scenario in pick(args, h.rng):
                result = runner.run_scenario(h, scenario)
                results.append(result)
                shown = (f", publishing stopped {result.unavailability_s} s"
                         if result.unavailability_s is not None else "")
                print(f"  {scenario.name}: {'ok' if result.ok else 'FAILED'} "
                      f"({result.kills} kills, recovered in {result.recovery_s} s{shown})",
                      flush=True)
                if deadline and time.monotonic() > deadline:
                    break
            if deadline and time.monotonic() > deadline:
                break
            if not deadline and rounds >= args.rounds:
                break
    finally:
        h.stop()
    rep = runner.report(h, results, started, time.monotonic() - t0,
                        full=bool(args.full or args.soak))
    if args.network:  # the same plan needs the proxied harness again
        rep["replay"] = rep["replay"].replace(" -m tests.faults ", " -m tests.faults --network ")
    print(runner.table(rep))
    runner.write(rep, Path(args.report or ROOT / report_file(args)))
    if not rep["ok"]:
        print(f"FAILED with seed {seed}; replay: {rep['replay']}; logs in {workdir}/logs",
              file=sys.stderr)
    return rep


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    p.add_argument("--seed", type=int, help="replay this seed (default: a random one)")
    p.add_argument("--scenarios", help="comma-separated scenario names (default: all chosen)")
    p.add_argument("--full", action="store_true", help="every scenario, outages of 20-60 s")
    p.add_argument("--soak", type=float, default=0, metavar="MINUTES",
                   help="repeat the full set for this many minutes")
    p.add_argument("--outage", type=float, default=20, help="broker outage seconds (CI set)")
    p.add_argument("--orders", type=int, default=8, help="orders per scenario wave")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--consumers", type=int, default=2)
    p.add_argument("--cluster", action="store_true",
                   help="production's topology: 3 Kafka nodes, PostgreSQL + synchronous standby")
    p.add_argument("--network", action="store_true",
                   help="network faults: every process behind a Toxiproxy proxy of its own")
    p.add_argument("--partition-s", type=float, default=30.0,
                   help="--network: how long a partition (and a slowed path) lasts")
    p.add_argument("--half-open-s", type=float, default=60.0,
                   help="--network: how long a half-open connection is held at most")
    p.add_argument("--rounds", type=int, default=1, help="repeat the chosen set N times")
    p.add_argument("--report", help="where the JSON report goes (default: faults-report.json, "
                   "or faults-report-cluster.json with --cluster, at the repository root)")
    p.add_argument("--workdir", help="where services and logs go (default: a temp dir)")
    return p.parse_args(argv)


def report_file(args: argparse.Namespace) -> str:
    if args.network:
        return "faults-report-network.json"
    return "faults-report-cluster.json" if args.cluster else "faults-report.json"


def main(argv: list[str] | None = None) -> int:
    return 0 if run(parse(argv))["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
