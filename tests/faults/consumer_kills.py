"""The fault harness's per-key scenario: consumers handling 64 messages at once (per-message
mode, ``OUTBOXKIT_CONSUMER_CONCURRENCY=64``), each order under a key of its own and the
supplier answering slowly, SIGKILLed while the calls are in flight; the harness's invariants
(nothing lost, one supplier order per run, per-key order in Kafka) then hold."""

from __future__ import annotations

import time
import uuid

from tests.faults.harness import Harness, ScenarioResult
from tests.faults.scenarios import Scenario, _wait

CONCURRENCY = 64
WAVE = 80  # orders per round, each under its own key: enough for half the victim's threads
IN_FLIGHT = "outboxkit_consumer_in_flight"


def consumer_kills(rounds: int = 3) -> Scenario:
    """Each round seeds a wave of orders (one key each), waits until a consumer has at least
    half its threads inside the supplier's call (0.4-0.8 s; its ``in_flight`` gauge), then
    SIGKILLs it and restarts it at once. Per-key order and one effect per message must hold
    although the killed process's dedup marks and offsets were mid-flight."""
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
            items = [f"consumer-kills-{n}-{i}" for i in range(WAVE)]
            run_ids += h.seed_orders(f"consumer-kills-{n}", items, accounts=WAVE)
            victim = h.rng.choice(h.names("consumer"))
            seen: list[float] = [0.0]

            def busy(name: str = victim, seen: list[float] = seen) -> bool:
                seen[0] = max(seen[0], h.p.metric(name, IN_FLIGHT) or 0.0)
                return seen[0] >= CONCURRENCY // 2

            if not _wait(busy, 60):
                r.unexpected.append(f"round {n + 1}: {victim} never had {CONCURRENCY // 2} "
                                    f"messages in flight (at most {seen[0]:.0f})")
            time.sleep(h.rng.uniform(0.0, 0.3))
            h.p.kill(victim)
            r.kills += 1
            peaks.append(seen[0])
            r.notes.append(f"killed {victim} with {seen[0]:.0f} in flight")
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
