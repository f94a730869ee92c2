"""The fault harness's per-key scenario: consumers handling 64 messages at once (per-message
mode, ``OUTBOXKIT_CONSUMER_CONCURRENCY=64``), each order under a key of its own and the
supplier answering slowly, SIGKILLed while the calls are in flight; the harness's invariants
(nothing lost, one supplier order per run, per-key order in Kafka) then hold."""

from __future__ import annotations

import time
import uuid

from sqlalchemy import text

from tests.faults.harness import Harness, ScenarioResult
from tests.faults.scenarios import Scenario, wait_for

CONCURRENCY = 64
WAVE = 100  # orders per round, each under its own key: more than the threads of a consumer
# How many calls must be in flight in one consumer before the kill: a quarter of its
# threads. Half was asked first; under CI's load one round peaked at 24 (the wave's
# partitions split between the consumers as they joined, 2026-12-05).
KILL_AT = CONCURRENCY // 4
IN_FLIGHT = "outboxkit_consumer_in_flight"


def _all_waiting(h: Harness, run_ids: list[uuid.UUID]) -> bool:
    """Every run of *run_ids* committed its order.submit (it waits for the supplier)."""
    assert h.engine is not None
    with h.engine.connect() as db:
        left = db.execute(text("SELECT count(*) FROM outboxkit.agent_runs WHERE id = ANY(:ids) "
                               "AND state IN ('queued', 'running')"), {"ids": run_ids})
        return int(left.scalar_one()) == 0


def consumer_kills(rounds: int = 3) -> Scenario:
    """Each round stops the consumers, seeds a wave of orders (one key each) and lets the
    agents and the relay send them, starts the consumers again, waits until one has at
    least a quarter of its threads inside the supplier's call (0.4-0.8 s; its ``in_flight``
    gauge),
    then SIGKILLs the busiest and restarts it at once. Per-key order and one effect per
    message must hold although the killed process's marks and offsets were mid-flight."""
    scenario = Scenario(f"consumer-kills:{rounds}", lambda h, r: [], settle_s=120)

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        assert h.supplier is not None
        h.p.overrides["consumer"] = {"OUTBOXKIT_CONSUMER_CONCURRENCY": str(CONCURRENCY)}
        for name in h.names("consumer"):
            h.p.restart(name)
        h.wait_ready()
        h.supplier.control(orders={"mode": "slow", "delay": h.rng.uniform(0.4, 0.8)})
        run_ids: list[uuid.UUID] = []
        peaks: list[float] = []
        for n in range(rounds):
            # The wave waits in Kafka while the consumers are down, so that it arrives at
            # once: how many calls are in flight is then the consumers' concurrency, not how
            # fast the agents emit.
            consumers = h.names("consumer")
            for name in consumers:
                h.p.stop(name)
            items = [f"consumer-kills-{n}-{i}" for i in range(WAVE)]
            wave = h.seed_orders(f"consumer-kills-{n}", items, accounts=WAVE)
            run_ids += wave
            if not wait_for(lambda w=wave: _all_waiting(h, w), 60):
                r.unexpected.append(f"round {n + 1}: the wave's orders were not all sent")
            time.sleep(1.0)  # the relay's last batch
            for name in consumers:
                h.p.restart(name)
            seen: dict[str, float] = {}

            def busy(seen: dict[str, float] = seen, names: list[str] = consumers) -> bool:
                for name in names:
                    seen[name] = max(seen.get(name, 0.0), h.p.metric(name, IN_FLIGHT) or 0.0)
                return max(seen.values()) >= KILL_AT

            if not wait_for(busy, 60):
                r.unexpected.append(f"round {n + 1}: no consumer had {KILL_AT} "
                                    f"messages in flight (at most {max(seen.values()):.0f})")
            victim = max(seen, key=lambda name: seen[name])
            h.p.kill(victim)
            r.kills += 1
            peaks.append(seen[victim])
            r.notes.append(f"killed {victim} with {seen[victim]:.0f} in flight")
            h.p.restart(victim)
        r.fault_ended = time.monotonic()
        r.figures = {"in flight at each kill (gauge, at least)": peaks}
        return run_ids

    def restore(h: Harness) -> None:
        assert h.supplier is not None
        h.supplier.control(orders={"mode": "normal"})
        h.p.overrides.pop("consumer", None)
        for name in h.names("consumer"):
            h.p.restart(name)
        h.wait_ready()

    scenario.run, scenario.after = run, restore
    return scenario
