"""The fault harness on production's topology, in CI: ONE cluster scenario per run (a 3-node
Kafka cluster, a PostgreSQL primary with a synchronous standby, the whole supplier-order
pipeline and the publish probe), chosen by the seed so that the set rotates day by day.

The seed defaults to the days since the epoch (another scenario each day);
``OUTBOXKIT_FAULTS_SEED`` replays one. The whole set, with figures and medians over rounds,
is ``make faults`` (``python -m tests.faults --cluster --rounds 3``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.faults import __main__ as faults
from tests.faults.cluster_scenarios import cluster_set
from tests.faults.runner import table


def seed() -> int:
    return int(os.environ.get("OUTBOXKIT_FAULTS_SEED") or int(time.time() // 86400))


@pytest.mark.timeout(300)
def test_a_cluster_fault_loses_nothing_and_repeats_no_effect(tmp_path: Path) -> None:
    chosen = seed()
    names = [s.name for s in cluster_set()]
    scenario = names[chosen % len(names)]
    print(f"\ncluster fault scenario {scenario!r} (seed {chosen}; OUTBOXKIT_FAULTS_SEED={chosen}"
          " replays it)")
    report = faults.run(faults.parse([
        "--cluster", "--seed", str(chosen), "--scenarios", scenario, "--orders", "6",
        "--workdir", str(tmp_path), "--report", str(tmp_path / "faults-report-cluster.json"),
    ]))
    shown = table(report)
    print(shown)
    assert [r["name"] for r in report["results"]] == [scenario], shown
    assert report["lost"] == 0, shown
    assert report["double_effects"] == 0, shown
    assert report["committed"] > 0, shown
    assert report["in_kafka"] == report["committed"], shown
    assert set(report["runs_by_state"]) <= {"done", "failed", "needs-human"}, shown
    assert report["ok"], f"seed {chosen}: {report['replay']}\n{shown}"
