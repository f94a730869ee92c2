"""Runs scenarios one after another on one harness and turns them into the report."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import text

from examples.supplier_order.invariants import path_of
from tests.faults.harness import Harness, ScenarioResult
from tests.faults.scenarios import Scenario


def run_scenario(h: Harness, scenario: Scenario) -> ScenarioResult:
    r = ScenarioResult(scenario.name)
    dropped_before = h.duplicates_dropped()
    run_ids = []
    try:
        run_ids = scenario.run(h, r)
    except Exception as exc:  # a scenario that cannot run is a failed scenario, not a crash
        r.error = f"{type(exc).__name__}: {exc}"
    fault_ended = r.fault_ended or time.monotonic()
    if not h.wait_final(run_ids, scenario.settle_s):
        r.notes.append(f"not settled within {scenario.settle_s:.0f} s")
    r.recovery_s = round(time.monotonic() - fault_ended, 2)
    if scenario.after is not None:
        try:
            scenario.after(h)
        except Exception as exc:
            r.error = r.error or f"undoing the scenario failed: {type(exc).__name__}: {exc}"
    h.check(r, run_ids)
    r.duplicates_dropped -= dropped_before
    _expectations(h, r, scenario)
    return r


def _expectations(h: Harness, r: ScenarioResult, scenario: Scenario) -> None:
    assert h.engine is not None
    with h.engine.connect() as conn:
        for run_id, wanted in (scenario.expect or {}).items():
            state = conn.execute(text("SELECT state FROM outboxkit.agent_runs WHERE id = :i"),
                                 {"i": run_id}).scalar_one()
            if state != wanted:
                r.unexpected.append(f"run {run_id}: {state}, expected {wanted}")
        for run_id, label in r.run_labels.items():
            events = conn.execute(text(
                "SELECT e.kind || ':' || e.outcome FROM outboxkit.operation_events e "
                "JOIN outboxkit.operations o ON o.id = e.operation_id WHERE o.run_id = :i "
                "ORDER BY e.id"), {"i": run_id}).scalars().all()
            r.paths_taken[label] = path_of(events)
            expected = r.expected_paths.get(label)
            if expected and r.paths_taken[label] != expected:
                r.unexpected.append(f"{label}: took {r.paths_taken[label]!r}, "
                                    f"expected {expected!r}")


def result_json(r: ScenarioResult) -> dict[str, Any]:
    f = r.findings
    return {
        "name": r.name, "ok": r.ok, "error": r.error, "kills": r.kills,
        "recovery_s": r.recovery_s, "duplicates_dropped": r.duplicates_dropped,
        "notes": r.notes, "unexpected": r.unexpected, "paths_taken": r.paths_taken,
        "expected_paths": r.expected_paths, **(f.as_json() if f else {}),
    }


def report(h: Harness, results: list[ScenarioResult], started: str,
           elapsed_s: float, *, full: bool = False) -> dict[str, Any]:
    states: Counter[str] = Counter()
    for r in results:
        states.update(r.findings.runs_by_state if r.findings else {})

    def total(attr: str) -> int:
        return sum(_size(getattr(r.findings, attr)) for r in results if r.findings)

    return {
        "seed": h.seed, "started": started, "elapsed_s": round(elapsed_s, 1),
        "topology": vars(h.topology), "replay": replay_command(h.seed, results, full=full),
        "ok": all(r.ok for r in results),
        "scenarios": len(results),
        "kills": sum(r.kills for r in results),
        "committed": total("committed"),
        "in_kafka": total("in_kafka"),
        "duplicates_delivered": total("duplicates_delivered"),
        "duplicates_dropped": sum(r.duplicates_dropped for r in results),
        "supplier_effects": total("supplier_effects"),
        "lost": total("lost"),
        "double_effects": total("double_effects"),
        "runs_by_state": dict(states),
        "recovery_s": {r.name: r.recovery_s for r in results},
        "results": [result_json(r) for r in results],
    }


def _size(value: Any) -> int:
    return len(value) if isinstance(value, list) else int(value)


def replay_command(seed: int, results: list[ScenarioResult], *, full: bool = False) -> str:
    """The command that replays the same plan (for a soak: its first round of scenarios)."""
    names = ",".join(dict.fromkeys(r.name for r in results))
    mode = " --full" if full else ""
    return f".venv/bin/python -m tests.faults --seed {seed}{mode} --scenarios '{names}'"


def table(rep: dict[str, Any]) -> str:
    head = (f"{'scenario':32} {'ok':3} {'kills':>5} {'commit':>6} {'kafka':>6} {'dupK':>5} "
            f"{'dupDrop':>7} {'orders':>6} {'lost':>4} {'double':>6} {'recov s':>7}  runs")
    lines = [head, "-" * len(head)]
    for r in rep["results"]:
        lines.append(
            f"{r['name'][:32]:32} {'yes' if r['ok'] else 'NO':3} {r['kills']:>5} "
            f"{r.get('committed', 0):>6} {r.get('in_kafka', 0):>6} "
            f"{r.get('duplicates_delivered', 0):>5} {r['duplicates_dropped']:>7} "
            f"{r.get('supplier_effects', 0):>6} {len(r.get('lost', [])):>4} "
            f"{len(r.get('double_effects', [])):>6} {r['recovery_s'] or 0:>7.1f}  "
            f"{r.get('runs_by_state', {})}")
        for label, path in r["paths_taken"].items():
            lines.append(f"    {label:>10}: {path}")
        for problem in [*r.get("violations", []), *r["unexpected"], *filter(None, [r["error"]])]:
            lines.append(f"    !! {problem}")
    lines.append("-" * len(head))
    lines.append(
        f"{rep['scenarios']} scenarios, {rep['kills']} kills, {rep['committed']} committed, "
        f"{rep['in_kafka']} in Kafka, {rep['duplicates_delivered']} duplicates delivered, "
        f"{rep['duplicates_dropped']} dropped, {rep['supplier_effects']} supplier orders, "
        f"lost {rep['lost']}, double effects {rep['double_effects']}, "
        f"runs {rep['runs_by_state']}")
    return "\n".join(lines)


def write(rep: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(rep, indent=2, default=str) + "\n")
