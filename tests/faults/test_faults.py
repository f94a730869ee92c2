"""The fault harness's CI subset: every failpoint of the agents and consumers kills its process
at least once, a few random kills, a PostgreSQL restart, PostgreSQL crashes (crash recovery
issuing transaction ids again), the supplier's failure paths, a consumer killed during a
hanging call, agent workers running 8 steps at once SIGKILLed mid-step, and consumers
handling 64 messages at once SIGKILLed mid-call —
and after each, nothing lost, no effect repeated, every run settled with evidence.

The seed is fixed so CI is repeatable (``OUTBOXKIT_FAULTS_SEED`` picks another); the
scenarios in a loop are ``make faults-soak`` (``python -m tests.faults --soak 30``), and the
leak soak (no faults, every daemon's memory and handles sampled) is ``make soak``
(``python -m tests.faults.soak``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from outbox.runtime.failpoints import FAILPOINTS
from tests.faults import __main__ as faults
from tests.faults.consumer_kills import KILL_AT, consumer_kills
from tests.faults.runner import table
from tests.faults.scenarios import FAILPOINT_KIND, ci_subset

# Proved once, by end-to-end tests that run with both Kafka clients and look closer: the
# relay's failpoints (tests/e2e/test_relay_crashes.py: the duplicates each kill leaves, per-key
# order) and the broker outage (tests/e2e/test_relay_failures.py: the relay and a consumer
# live through it, readiness, every message in Kafka and its effect once). `make faults`
# still plays them here, in the whole pipeline.
IN_E2E = {
    "failpoint:relay.after_send",
    "failpoint:relay.after_ack",
    "failpoint:relay.after_mark",
    "broker-outage:20s",
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_nothing_is_lost_and_no_effect_repeats_under_faults(tmp_path: Path) -> None:
    seed = os.environ.get("OUTBOXKIT_FAULTS_SEED", "20261202")
    played = [s.name for s in ci_subset() if s.name not in IN_E2E]
    assert len(played) == len(ci_subset()) - len(IN_E2E)  # the names above are still current
    played.append(consumer_kills().name)
    report = faults.run(faults.parse([
        "--seed", seed, "--workdir", str(tmp_path), "--report", str(ROOT / report_name()),
        "--scenarios", ",".join(played),
    ]))
    shown = table(report)
    results = {r["name"]: r for r in report["results"]}
    for name in FAILPOINT_KIND:  # each failpoint played here really killed a process
        if f"failpoint:{name}" not in IN_E2E:
            assert results[f"failpoint:{name}"]["kills"] >= 1, shown
    # The others are the durable agent's, each played by its own crash test, and the
    # consumer watchdog's, played by its test (they stall a client, they kill nothing).
    crash_tests = (ROOT / "tests" / "e2e" / "test_agents_crash.py").read_text()
    watchdog_tests = (ROOT / "tests" / "e2e" / "test_consumer_watchdog.py").read_text()
    for name in set(FAILPOINTS) - set(FAILPOINT_KIND):
        if name in ("consumer.leave_group", "consumer.stuck_fetch"):
            assert f'"{name}"' in watchdog_tests, name
            continue
        assert name.startswith("agent."), name
        assert f'"{name}"' in crash_tests, name
    assert report["lost"] == 0, shown
    assert report["double_effects"] == 0, shown
    assert report["committed"] > 0, shown
    assert report["in_kafka"] == report["committed"], shown
    assert set(report["runs_by_state"]) <= {"done", "failed", "needs-human"}, shown
    paths = results["supplier-paths"]["paths_taken"]
    assert paths["refuse"] == "call:rejected", shown
    assert paths["timeout"] == "call:unknown → check:confirmed", shown
    assert results["status-endpoint-down"]["runs_by_state"] == {"needs-human": 1}, shown
    # PostgreSQL really crashed each time (its probe messages are counted in "lost" above).
    assert results["postgres-crash"]["kills"] == 3, shown
    # Killed during a hanging call, with the consumer's default retries: settled, not stranded.
    assert results["hanging-call:30s"]["runs_by_state"] == {"done": 1}, shown
    # Agent workers at concurrency 8, SIGKILLed 4 times (one agent, one, then both) while
    # several steps stalled inside the step function: every one of those steps rolled back,
    # its run resumed and committed its order.submit once.
    worker = results["worker-kills:3"]
    assert worker["kills"] == 4, shown
    assert all(k["interrupted_after_write"] >= 2 for k in worker["figures"]["kills"]), shown
    assert worker["figures"]["summary"]["order.submit per run (min, max)"] == [1, 1], shown
    assert set(worker["runs_by_state"]) == {"done"}, shown
    # Consumers at concurrency 64, each order its own key, SIGKILLed 3 times with at least
    # a quarter of their threads inside the supplier's call: every run done, one order each.
    keyed = results[consumer_kills().name]
    assert keyed["kills"] == 3, shown
    assert min(keyed["figures"]["in flight at each kill (gauge, at least)"]) >= KILL_AT, shown
    assert set(keyed["runs_by_state"]) == {"done"}, shown
    assert report["ok"], f"seed {seed}: {report['replay']}\n{shown}"


def report_name() -> str:
    """faults-report.json with the default Kafka client, faults-report-<client>.json else."""
    client = os.environ.get("OUTBOXKIT_KAFKA_CLIENT", "") or "kafka-python"
    return "faults-report.json" if client == "kafka-python" else f"faults-report-{client}.json"
