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
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults import __main__ as faults
from tests.faults.cluster_scenarios import cluster_set
from tests.faults.runner import table
from tests.faults.topology import cleanup_after


def seed() -> int:
    return int(os.environ.get("OUTBOXKIT_FAULTS_SEED") or int(time.time() // 86400))


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """The harness stops what it started; this stops, by the pids in its folders, whatever
    it could not (a failed start, an interrupted stop)."""
    try:
        yield tmp_path
    finally:
        cleanup_after(tmp_path)


@pytest.mark.timeout(300)
def test_a_cluster_fault_loses_nothing_and_repeats_no_effect(workdir: Path) -> None:
    chosen = seed()
    names = [s.name for s in cluster_set()]
    scenario = names[chosen % len(names)]
    print(f"\ncluster fault scenario {scenario!r} (seed {chosen}; OUTBOXKIT_FAULTS_SEED={chosen}"
          " replays it)")
    report = faults.run(faults.parse([
        "--cluster", "--seed", str(chosen), "--scenarios", scenario, "--orders", "6",
        "--workdir", str(workdir), "--report", str(workdir / "faults-report-cluster.json"),
    ]))
    shown = table(report)
    assert [r["name"] for r in report["results"]] == [scenario], shown
    assert report["lost"] == 0, shown
    assert report["double_effects"] == 0, shown
    assert report["committed"] > 0, shown
    assert report["in_kafka"] == report["committed"], shown
    assert set(report["runs_by_state"]) <= {"done", "failed", "needs-human"}, shown
    assert report["ok"], f"seed {chosen}: {report['replay']}\n{shown}"
