"""Runs scenarios one after another on one harness and turns them into the report."""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from sqlalchemy import text

from examples.supplier_order.invariants import path_of
from tests.faults.harness import Harness, ScenarioResult
from tests.faults.scenarios import Scenario


def run_scenario(h: Harness, scenario: Scenario) -> ScenarioResult:
    r = ScenarioResult(scenario.name)
    dropped_before = h.duplicates_dropped()
    restarted_before, began = len(h.restarted), time.time()
    started = time.monotonic()
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
    if scenario.check is not None:
        try:
            scenario.check(h, r)
        except Exception as exc:
            r.error = r.error or f"the scenario's own check failed: {type(exc).__name__}: {exc}"
    r.duplicates_dropped -= dropped_before
    r.restarts = h.restarted[restarted_before:]
    if h.probe is not None:
        _probe_figures(h, r, began)
        _drained(h, r, run_ids)
        _lost_evidence(h, r)
    _expectations(h, r, scenario)
    r.elapsed_s = round(time.monotonic() - started, 1)
    return r


def _probe_figures(h: Harness, r: ScenarioResult, began: float) -> None:
    """Unavailability from the probe's append times; the probe's acked messages checked
    like the scenario's (lost = 0 covers them too); processes heal() had to restart."""
    assert h.probe is not None
    window = r.fault_window or (began, time.time())
    try:
        pf = h.probe.figures(window, since=began, until=time.time())
    except Exception as exc:
        r.error = r.error or f"reading the publish probe failed: {type(exc).__name__}: {exc}"
        return
    r.unavailability_s = pf.unavailability_s
    r.probe_lost = pf.lost
    r.probe = {"acked": pf.acked, "unknown": pf.unknown, "lost": len(pf.lost),
               "resent": pf.resent, "gap": [pf.gap_from, pf.gap_to]}
    r.resent = pf.resent + (r.findings.duplicates_delivered if r.findings else 0)
    r.notes.append(f"probe: {pf.acked} commits acked, {pf.unknown} raised (unknown), "
                   f"{len(pf.lost)} lost, {pf.resent} resent")
    if r.restarts:
        r.notes.append(f"finding: heal() had to restart {', '.join(r.restarts)}")


def _lost_evidence(h: Harness, r: ScenarioResult) -> None:
    """Keep what is needed to chase a lost message: its row (xid, commit-side time, lane,
    status) and where the relays' logs are."""
    lost = [*(r.findings.lost if r.findings else []), *r.probe_lost]
    if not lost or h.engine is None:
        return
    with h.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT message_id::text, id, xid::text, created_at, lane, status, topic "
            "FROM outboxkit.outbox_messages WHERE message_id::text = ANY(:ids) ORDER BY id"),
            {"ids": lost}).all()
    r.notes.append(f"LOST {len(lost)} (relay logs: {h.p.workdir}); rows (message id, id, "
                   "xid, created_at, lane, status, topic):")
    r.notes += [f"  {tuple(str(v) for v in row)}" for row in rows[:20]]


def _drained(h: Harness, r: ScenarioResult, run_ids: list[Any]) -> None:
    """On the cluster, recovery_s counts from the fault's start (not its end: the scenario
    decides how long a node stays down, and the cluster moves on without it) until the last
    of the scenario's runs reached its final state: the backlog the fault built is drained."""
    if r.fault_window is None or not run_ids or h.engine is None:
        return
    with h.engine.connect() as conn:
        last = conn.execute(text(
            "SELECT extract(epoch FROM max(updated_at)) FROM outboxkit.agent_runs "
            "WHERE id = ANY(:ids)"), {"ids": run_ids}).scalar_one()
    if last is not None:
        r.recovery_s = round(max(0.0, float(last) - r.fault_window[0]), 2)


def _expectations(h: Harness, r: ScenarioResult, scenario: Scenario) -> None:
    assert h.engine is not None
    with h.engine.connect() as conn:
        for run_id, wanted in (scenario.expect or {}).items():
            state = conn.execute(text("SELECT state FROM outboxkit.agent_runs WHERE id = :i"),
                                 {"i": run_id}).scalar_one()
            if state != wanted:
                r.unexpected.append(f"run {run_id}: {state}, expected {wanted}")
        for labelled, label in r.run_labels.items():
            events = conn.execute(text(
                "SELECT e.kind || ':' || e.outcome FROM outboxkit.operation_events e "
                "JOIN outboxkit.operations o ON o.id = e.operation_id WHERE o.run_id = :i "
                "ORDER BY e.id"), {"i": labelled}).scalars().all()
            r.paths_taken[label] = path_of(events)
            expected = r.expected_paths.get(label)
            if expected and r.paths_taken[label] != expected:
                r.unexpected.append(f"{label}: took {r.paths_taken[label]!r}, "
                                    f"expected {expected!r}")


def result_json(r: ScenarioResult) -> dict[str, Any]:
    f = r.findings
    return {
        "name": r.name, "ok": r.ok, "error": r.error, "kills": r.kills,
        "recovery_s": r.recovery_s, "elapsed_s": r.elapsed_s,
        "duplicates_dropped": r.duplicates_dropped,
        "notes": r.notes, "unexpected": r.unexpected, "paths_taken": r.paths_taken,
        "expected_paths": r.expected_paths, "figures": r.figures,
        **(f.as_json() if f else {}),
        "fault_window": r.fault_window, "unavailability_s": r.unavailability_s,
        "resent": r.resent, "restarts": r.restarts, "probe": r.probe,
        "probe_lost": r.probe_lost,
    }


def report(h: Harness, results: list[ScenarioResult], started: str,
           elapsed_s: float, *, full: bool = False) -> dict[str, Any]:
    states: Counter[str] = Counter()
    for r in results:
        states.update(r.findings.runs_by_state if r.findings else {})

    def total(attr: str) -> int:
        return sum(_size(getattr(r.findings, attr)) for r in results if r.findings)

    cluster = h.cluster is not None
    return {
        "seed": h.seed, "started": started, "elapsed_s": round(elapsed_s, 1),
        "topology": vars(h.topology),
        "replay": replay_command(h.seed, results, full=full, cluster=cluster),
        "cluster": cluster,
        **(cluster_summary(results) if cluster else {}),
        "ok": all(r.ok for r in results),
        "scenarios": len(results),
        "kills": sum(r.kills for r in results),
        "committed": total("committed"),
        "in_kafka": total("in_kafka"),
        "duplicates_delivered": total("duplicates_delivered"),
        "duplicates_dropped": sum(r.duplicates_dropped for r in results),
        "supplier_effects": total("supplier_effects"),
        "lost": total("lost") + sum(len(r.probe_lost) for r in results),
        "double_effects": total("double_effects"),
        "runs_by_state": dict(states),
        "recovery_s": {r.name: r.recovery_s for r in results},
        "results": [result_json(r) for r in results],
    }


def _size(value: Any) -> int:
    return len(value) if isinstance(value, list) else int(value)


def cluster_summary(results: list[ScenarioResult]) -> dict[str, Any]:
    """Per scenario, the medians over rounds; and the issue's goals, checked (not asserted):
    nothing lost and no double effect anywhere, publishing back within 10 s of a leader's
    SIGKILL and within 15 s of a PostgreSQL failover (median unavailability)."""
    by_name: dict[str, list[ScenarioResult]] = defaultdict(list)
    for r in results:
        by_name[r.name].append(r)

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 2) if known else None

    medians = {
        name: {"rounds": len(rs),
               "unavailability_s": median([r.unavailability_s for r in rs]),
               "recovery_s": median([r.recovery_s for r in rs]),
               "restarts": sum(len(r.restarts) for r in rs)}
        for name, rs in by_name.items()
    }

    def within(name: str, limit: float) -> bool | None:
        got = medians.get(name, {}).get("unavailability_s")
        return None if got is None else bool(got <= limit)

    lost = sum(len(r.findings.lost) if r.findings else 0 for r in results)
    lost += sum(len(r.probe_lost) for r in results)
    doubles = sum(len(r.findings.double_effects) if r.findings else 0 for r in results)
    goals = {
        "lost_0": lost == 0,
        "double_effects_0": doubles == 0,
        "leader_kill_resumes_within_10s": within("leader-kill", 10.0),
        "pg_failover_resumes_within_15s": within("pg-failover", 15.0),
    }
    return {"medians": medians, "goals": goals}


def replay_command(seed: int, results: list[ScenarioResult], *, full: bool = False,
                   cluster: bool = False) -> str:
    """The command that replays the same plan (for a soak: its first round of scenarios)."""
    names = ",".join(dict.fromkeys(r.name for r in results))
    mode = " --full" if full else ""
    mode += " --cluster" if cluster else ""
    return f".venv/bin/python -m tests.faults --seed {seed}{mode} --scenarios '{names}'"


def table(rep: dict[str, Any]) -> str:
    head = (f"{'scenario':32} {'ok':3} {'kills':>5} {'commit':>6} {'kafka':>6} {'dupK':>5} "
            f"{'dupDrop':>7} {'orders':>6} {'lost':>4} {'double':>6} {'recov s':>7}  runs")
    cluster = bool(rep.get("cluster"))
    if cluster:
        head = head.replace("  runs", f" {'unavail':>7} {'resent':>6} {'rst':>3}  runs")
    lines = [head, "-" * len(head)]
    for r in rep["results"]:
        extra = ""
        if cluster:
            unavailable = r.get("unavailability_s")
            shown = f"{unavailable:.1f}" if unavailable is not None else "-"
            extra = f" {shown:>7} {r.get('resent', 0):>6} {len(r.get('restarts', [])):>3}"
        lost = len(r.get("lost", [])) + len(r.get("probe_lost", []))
        lines.append(
            f"{r['name'][:32]:32} {'yes' if r['ok'] else 'NO':3} {r['kills']:>5} "
            f"{r.get('committed', 0):>6} {r.get('in_kafka', 0):>6} "
            f"{r.get('duplicates_delivered', 0):>5} {r['duplicates_dropped']:>7} "
            f"{r.get('supplier_effects', 0):>6} {lost:>4} "
            f"{len(r.get('double_effects', [])):>6} {r['recovery_s'] or 0:>7.1f}{extra}  "
            f"{r.get('runs_by_state', {})}")
        if cluster:
            for note in r["notes"]:
                lines.append(f"    {note}")
        for label, path in r["paths_taken"].items():
            lines.append(f"    {label:>10}: {path}")
        for what, value in r.get("figures", {}).get("summary", {}).items():
            lines.append(f"    {what}: {value}")
        for problem in [*r.get("violations", []), *r["unexpected"], *filter(None, [r["error"]])]:
            lines.append(f"    !! {problem}")
    lines.append("-" * len(head))
    lines.append(
        f"{rep['scenarios']} scenarios, {rep['kills']} kills, {rep['committed']} committed, "
        f"{rep['in_kafka']} in Kafka, {rep['duplicates_delivered']} duplicates delivered, "
        f"{rep['duplicates_dropped']} dropped, {rep['supplier_effects']} supplier orders, "
        f"lost {rep['lost']}, double effects {rep['double_effects']}, "
        f"runs {rep['runs_by_state']}")
    if cluster:
        lines.append("medians over rounds (unavailability s / recovery s / restarts):")
        for name, m in rep["medians"].items():
            lines.append(f"    {name:28} {m['unavailability_s']} / {m['recovery_s']} / "
                         f"{m['restarts']}  ({m['rounds']} rounds)")
        lines.append(f"goals: {rep['goals']}")
    return "\n".join(lines)


def write(rep: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(rep, indent=2, default=str) + "\n")
