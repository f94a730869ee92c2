"""The network fault scenarios in CI: ONE per run (every process behind a Toxiproxy proxy of
its own; a partition, a slowed path, half-open connections, or a relay fenced after its
lease ran out), chosen by the seed so that the set rotates day by day.

The seed defaults to the days since the epoch; ``OUTBOXKIT_FAULTS_SEED`` replays one. The
whole set is ``python -m tests.faults --network``. Toxiproxy is built by scripts/bootstrap:
a missing binary fails this test (it is not skipped).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from outbox.testing import toxiproxy
from tests.faults import __main__ as faults
from tests.faults.network_scenarios import RESUME_GOAL_S, network_set
from tests.faults.runner import table

# Lengths that keep one scenario, the harness's start and stop included, under a minute
# (`make faults` plays 30 s partitions and slow links, and 60 s half-open holds).
ARGS = ["--partition-s", "20", "--half-open-s", "30", "--orders", "6"]


def seed() -> int:
    return int(os.environ.get("OUTBOXKIT_FAULTS_SEED") or int(time.time() // 86400))


@pytest.mark.timeout(300)
def test_a_network_fault_loses_nothing_and_repeats_no_effect(tmp_path: Path) -> None:
    toxiproxy.executable()  # raises, naming the install command, when bootstrap did not build it
    chosen = seed()
    names = [s.name for s in network_set()]
    scenario = names[chosen % len(names)]
    print(f"\nnetwork fault scenario {scenario!r} (seed {chosen}; OUTBOXKIT_FAULTS_SEED={chosen}"
          " replays it)")
    started = time.monotonic()
    report = faults.run(faults.parse([
        "--network", "--seed", str(chosen), "--scenarios", scenario, *ARGS,
        "--workdir", str(tmp_path), "--report", str(tmp_path / "faults-report-network.json"),
    ]))
    print(f"played in {time.monotonic() - started:.0f} s")
    shown = table(report)
    assert [r["name"] for r in report["results"]] == [scenario], shown
    assert report["lost"] == 0, shown
    assert report["double_effects"] == 0, shown
    assert report["committed"] > 0, shown
    assert report["in_kafka"] == report["committed"], shown
    assert set(report["runs_by_state"]) == {"done"}, shown
    figures = report["results"][0]["figures"]["summary"]
    if scenario.startswith("net-partition:"):
        assert figures[f"goal: resumed ≤ {RESUME_GOAL_S:.0f} s after heal"] is True, shown
    if scenario == "net-relay-fenced":
        assert figures["rounds with the late record fenced"] == 1, shown
        assert figures["duplicates in Kafka (published twice)"] >= 1, shown
        assert figures["per-key order violations"] == 0, shown
    if scenario == "net-half-open:pg":
        # Every client notices a silent PostgreSQL path within its answer bound (10 s in the
        # pipeline) and its reconnect's connect_timeout (5 s), and works again once the
        # path is back, unrestarted (docs/operations.md, "Network faults").
        assert report["results"][0]["figures"]["restarted"] == [], shown
        noticed = report["results"][0]["figures"]["noticed_s"]
        assert all(s is not None and s <= 25 for s in noticed.values()), shown
    if scenario == "net-half-open:kafka":
        # The relay's readiness check (5 s without an ack) and the consumer's request
        # timeout notice a silent broker well within the hold.
        noticed = report["results"][0]["figures"]["noticed_s"]
        assert all(s is not None and s <= 20 for s in noticed.values()), shown
    assert report["ok"], f"seed {chosen}: {report['replay']}\n{shown}"
