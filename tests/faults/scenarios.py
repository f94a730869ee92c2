"""The scenarios: each injects its faults while orders flow, then the harness heals what is
dead, waits for every order to settle and checks the invariants.

A scenario returns the run ids it seeded; it records kills, notes and what it expected of
particular runs (``expect``: run id → final state) in its result.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import text

from outbox.failpoints import FAILPOINTS
from tests.faults.harness import Harness, ScenarioResult

# Which process kind of the supplier-order pipeline passes each failpoint. The durable agent's
# (agent.*) are in no process of this pipeline: tests/e2e/test_agents_crash.py plays each.
FAILPOINT_KIND = {
    "outbox.after_checkpoint": "agent",
    "outbox.before_emit": "agent",
    "relay.after_send": "relay",
    "relay.after_ack": "relay",
    "relay.after_mark": "relay",
    "consumer.after_handler": "consumer",
    "consumer.after_db_commit": "consumer",
    "operations.after_call": "consumer",
}


@dataclass
class Scenario:
    name: str
    run: Callable[[Harness, ScenarioResult], list[uuid.UUID]]
    settle_s: float = 90.0
    expect: dict[uuid.UUID, str] | None = None
    # Run once the scenario's runs settled (or did not): undo what it changed.
    after: Callable[[Harness], None] | None = None


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def failpoint(name: str) -> Scenario:
    """Arm *name* with ``kill@N`` in every process of its kind; once one died, restart the
    others clean; the harness restarts the dead one."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        kind = FAILPOINT_KIND[name]
        nth = h.rng.randint(1, 3)  # a later hit is reached by sending more waves
        spec = f"{name}=kill@{nth};seed={h.seed}"
        r.notes.append(spec)
        armed = h.names(kind)
        for proc_name in armed:
            h.p.restart(proc_name, failpoints=spec)
        run_ids: list[uuid.UUID] = []
        fired = False
        for _ in range(12):  # waves of orders until an armed process reaches its Nth hit
            run_ids += h.seed_orders(name.replace(".", "-"))
            if _wait(lambda: any(not h.p.procs[n].alive for n in armed), 5):
                fired = True
                break
        if not fired:
            r.error = f"failpoint {name} never fired in 60 s"
        for proc_name in armed:
            if h.p.procs[proc_name].alive:
                h.p.stop(proc_name)  # disarm: a clean restart below
            else:
                r.kills += 1
        r.fault_ended = time.monotonic()
        return run_ids

    return Scenario(f"failpoint:{name}", run)


def random_kills(rounds: int) -> Scenario:
    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        run_ids: list[uuid.UUID] = []
        victims = [n for n in h.p.procs if n != "supplier"]
        for i in range(rounds):
            if i % 2 == 0:
                run_ids += h.seed_orders(f"random-kills-{i}")
            time.sleep(h.rng.uniform(0.3, 1.5))
            victim = h.rng.choice(victims)
            h.p.kill(victim)
            r.kills += 1
            r.notes.append(f"killed {victim}")
            time.sleep(h.rng.uniform(0.2, 1.0))
            h.p.restart(victim)
        r.fault_ended = time.monotonic()
        return run_ids

    return Scenario(f"random-kills:{rounds}", run)


def broker_outage(seconds: float) -> Scenario:
    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        run_ids = h.seed_orders("broker-outage-before")
        time.sleep(1.0)
        h.services.stop_kafka()
        r.kills += 1
        r.notes.append(f"Kafka stopped for {seconds:.0f} s")
        run_ids += h.seed_orders("broker-outage-during")  # commits go on without Kafka
        time.sleep(seconds)
        h.services.start_kafka()
        r.fault_ended = time.monotonic()
        return run_ids

    return Scenario(f"broker-outage:{seconds:.0f}s", run, settle_s=180)


def postgres_restart() -> Scenario:
    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        run_ids = h.seed_orders("postgres-restart")
        time.sleep(h.rng.uniform(0.5, 2.0))
        h.services.stop_postgres()
        r.kills += 1
        time.sleep(2.0)
        h.services.start_postgres()
        r.notes.append("PostgreSQL stopped and started under load")
        r.fault_ended = time.monotonic()
        return run_ids

    return Scenario("postgres-restart", run, settle_s=120)


def supplier_paths() -> Scenario:
    """The seeds' test: a slow answer, a permanent refusal and a timeout after applying each
    take their own path (wait; fail with evidence; reconcile), plus a dropped connection."""
    cases = {
        "slow": ({"mode": "slow", "delay": 0.8}, "done", "call:confirmed"),
        "refuse": ({"mode": "refuse"}, "failed", "call:rejected"),
        "timeout": ({"mode": "apply-then-timeout", "delay": 2.5, "times": 1}, "done",
                    "call:unknown → check:confirmed"),
        "dropped": ({"mode": "apply-then-drop", "times": 1}, "done",
                    "call:unknown → check:confirmed"),
    }
    scenario = Scenario("supplier-paths", lambda h, r: [])

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        tag = uuid.uuid4().hex[:4]
        items = {case: f"{case}-{tag}" for case in cases}
        assert h.supplier is not None
        h.supplier.control(items={items[c]: rule for c, (rule, _, _) in cases.items()})
        run_ids = h.seed_orders("supplier-paths", list(items.values()))
        scenario.expect = {rid: cases[c][1] for rid, c in zip(run_ids, cases, strict=True)}
        r.expected_paths = {c: cases[c][2] for c in cases}
        r.run_labels = {str(rid): c for rid, c in zip(run_ids, cases, strict=True)}
        r.fault_ended = time.monotonic()
        return run_ids

    scenario.run = run
    return scenario


def status_down() -> Scenario:
    """The supplier times out after applying and its status endpoint is down: the outcome
    cannot be established, so the run goes to a human with the evidence — never re-ordered."""
    scenario = Scenario("status-endpoint-down", lambda h, r: [])

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        assert h.supplier is not None
        item = f"unknowable-{uuid.uuid4().hex[:4]}"
        h.supplier.control(status={"mode": "down"},
                           items={item: {"mode": "apply-then-timeout", "delay": 2.5, "times": 1}})
        run_ids = h.seed_orders("status-down", [item])
        scenario.expect = {run_ids[0]: "needs-human"}
        assert h.engine is not None

        def escalated() -> bool:
            with h.engine.connect() as conn:  # type: ignore[union-attr]
                return bool(conn.execute(text(
                    "SELECT count(*) FROM outboxkit.agent_runs WHERE id = :i "
                    "AND state = 'needs-human'"), {"i": run_ids[0]}).scalar_one())

        if not _wait(escalated, 60):
            r.error = "the unknowable order was not escalated within 60 s"
        h.supplier.control(status={"mode": "normal"})
        r.fault_ended = time.monotonic()
        return run_ids

    scenario.run = run
    return scenario


def hanging_call(grace_s: float) -> Scenario:
    """The supplier takes an order and hangs; every consumer is SIGKILLed during the POST and
    restarted with the consumer's default retry budget (5 attempts, about 8 s here), far
    shorter than the ledger's in-flight grace: the operation stays ``pending`` until the
    reconciler asks the supplier. The message must wait for that outcome instead of being
    dead-lettered, and the run must end ``done`` with the supplier's evidence."""
    scenario = Scenario(f"hanging-call:{grace_s:.0f}s", lambda h, r: [], settle_s=grace_s + 90)
    tuned = ("consumer", "reconciler")

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        assert h.supplier is not None
        ledger = {"OUTBOXKIT_EXAMPLE_IN_FLIGHT_GRACE": str(grace_s),
                  "OUTBOXKIT_EXAMPLE_CALL_TIMEOUT": str(grace_s / 2)}
        h.p.overrides["consumer"] = {**ledger, "OUTBOXKIT_CONSUMER_MAX_ATTEMPTS": "5",
                                     "OUTBOXKIT_CONSUMER_BACKOFF_MAX_SECONDS": "10"}
        h.p.overrides["reconciler"] = ledger
        for name in [n for kind in tuned for n in h.names(kind)]:
            h.p.restart(name)
        h.wait_ready()
        item = f"hanging-{uuid.uuid4().hex[:4]}"
        h.supplier.control(items={item: {"mode": "apply-then-timeout", "delay": grace_s * 4,
                                         "times": 1}})
        run_ids = h.seed_orders("hanging-call", [item])
        scenario.expect = {run_ids[0]: "done"}
        if not _wait(lambda: any((o.get("request") or {}).get("item") == item
                                 for o in h.supplier.all_orders()), 60):
            r.error = "the supplier never received the hanging order"
            return run_ids
        consumers = h.names("consumer")
        for name in consumers:  # one of them is inside the POST, which hangs
            h.p.kill(name)
            r.kills += 1
        killed = time.monotonic()
        for name in consumers:
            h.p.restart(name)
        r.notes.append(f"consumers killed during the POST; in-flight grace {grace_s:.0f} s, "
                       "consumer retries at their defaults")
        r.fault_ended = killed
        return run_ids

    def restore(h: Harness) -> None:
        for kind in tuned:
            h.p.overrides.pop(kind, None)
        for name in [n for kind in tuned for n in h.names(kind)]:
            h.p.restart(name)
        h.wait_ready()

    scenario.run, scenario.after = run, restore
    return scenario


def scale_out(rounds: int) -> Scenario:
    """4 agents, 3 relays, 2 consumers at once, with random kills among them."""
    kills = random_kills(rounds)

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        for kind, names in (("agent", ["agent-3", "agent-4"]), ("relay", ["relay-3"])):
            for name in names:
                if name not in h.p.procs:
                    h.p.start(kind, name)
        r.notes.append("topology: " + ", ".join(sorted(n for n in h.p.procs)))
        return kills.run(h, r)

    return Scenario(f"scale-4-3-2:{rounds}", run, settle_s=150)


def ci_subset(outage_s: float = 20.0) -> list[Scenario]:
    """Every failpoint once, a few random kills, one broker outage, a PostgreSQL restart,
    and the supplier's paths: the part that runs in the normal test command."""
    return [
        supplier_paths(),
        status_down(),
        *(failpoint(name) for name in FAILPOINTS if name in FAILPOINT_KIND),
        random_kills(4),
        postgres_restart(),
        broker_outage(outage_s),
        hanging_call(30.0),
    ]


def full(outage_s: float, kill_rounds: int = 10) -> list[Scenario]:
    """Every scenario; the soak passes more kill rounds."""
    return [*ci_subset(outage_s), random_kills(kill_rounds), scale_out(kill_rounds),
            hanging_call(60.0)]  # the ledger's default in-flight grace
