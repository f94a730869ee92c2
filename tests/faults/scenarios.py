"""The scenarios: each injects its faults while orders flow, then the harness heals what is
dead, waits for every order to settle and checks the invariants.

A scenario returns the run ids it seeded; it records kills, notes and what it expected of
particular runs (``expect``: run id → final state) in its result.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from kafka.admin import KafkaAdminClient, NewTopic
from psycopg.rows import TupleRow
from sqlalchemy import text

from examples.supplier_order.invariants import read_topic
from outbox import Envelope
from outbox.db.dsn import libpq_url
from outbox.messages.emit import emit
from outbox.runtime.failpoints import FAILPOINTS
from outbox.settings import OutboxSettings
from outbox.testing import postgres
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
    # Run after the invariants were checked: the scenario's own checks, into its findings.
    check: Callable[[Harness, ScenarioResult], None] | None = None


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
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
            if wait_for(lambda: any(not h.p.procs[n].alive for n in armed), 5):
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


# Transactions that take an xid and whose WAL stays in PostgreSQL's memory (nothing flushes
# a rollback, nor a commit with synchronous_commit off: the WAL writer writes them within
# wal_writer_delay, 200 ms, unless a durable commit flushes them first). Run in autocommit:
# a DO block at top level may end its transactions itself.
BURN_XIDS = """DO $$ BEGIN
    FOR i IN 1..{rolled_back} LOOP PERFORM pg_current_xact_id(); ROLLBACK; END LOOP;
    FOR i IN 1..{committed} LOOP
        PERFORM set_config('synchronous_commit', 'off', true);
        PERFORM pg_current_xact_id();
        COMMIT;
    END LOOP;
END $$"""


def _connect(url: str, timeout_s: float) -> psycopg.Connection[TupleRow]:
    """An autocommit connection of the scenario's own, retried while the server recovers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=3)
        except psycopg.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _broken(conn: psycopg.Connection[TupleRow]) -> bool:
    try:
        conn.execute("SELECT 1")
        return False
    except psycopg.Error:
        return True


def seed_retrying(h: Harness, scenario: str, timeout_s: float) -> list[uuid.UUID]:
    """Seed a wave, retrying while the database does not take writes yet (a failover, a
    crash recovery)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return h.seed_orders(scenario)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _parent(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return None


def _tokens(conn: psycopg.Connection[TupleRow]) -> dict[int, tuple[str, int]]:
    """Each owned lane's owner and fencing token (a lease that ran out bumps the token)."""
    rows = conn.execute("SELECT lane, owner, token FROM outboxkit.relay_lanes "
                        "WHERE owner IS NOT NULL").fetchall()
    return {int(lane): (str(owner), int(token)) for lane, owner, token in rows}


def _undecided(h: Harness, run_ids: list[uuid.UUID]) -> int:
    """How many of *run_ids* the agents have not decided yet (no message emitted)."""
    assert h.engine is not None
    with h.engine.connect() as db:
        return int(db.execute(text(
            "SELECT count(*) FROM outboxkit.agent_runs WHERE id = ANY(:ids) "
            "AND state IN ('queued', 'running')"), {"ids": run_ids}).scalar_one())


def _lanes_steady(conn: psycopg.Connection[TupleRow], relays: list[str],
                  since: datetime) -> bool:
    """Every lane held under a running lease, each relay its fair share, and every relay
    renewed since *since*: a crash now comes a whole heartbeat interval before the next
    renewal (no durable commit of theirs flushes the WAL meanwhile), and its lease was
    renewed after the previous crash (a crash now is one lease away from the last renewal,
    not two)."""
    lanes = OutboxSettings().lanes
    rows = conn.execute(
        "SELECT l.owner, count(*), min(r.heartbeat_at) > %s "
        "FROM outboxkit.relay_lanes AS l JOIN outboxkit.relays AS r ON r.relay_id = l.owner "
        "WHERE l.lane < %s AND l.expires_at > now() GROUP BY l.owner", (since, lanes)).fetchall()
    held = {str(owner): int(count) for owner, count, _ in rows}
    return (set(held) == set(relays) and sum(held.values()) == lanes
            and max(held.values()) <= -(-lanes // len(relays)) and all(row[2] for row in rows))


def _db_now(conn: psycopg.Connection[TupleRow]) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    assert isinstance(row[0], datetime)
    return row[0]


def _next_xid(conn: psycopg.Connection[TupleRow]) -> int:
    """The next transaction id the server will issue (without taking one)."""
    row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
    assert row is not None
    return int(row[0])


def _crash_immediate(h: Harness) -> str:
    """The postmaster stopped in immediate mode (SIGQUIT, what `pg_ctl stop -m immediate`
    sends: every process exits at once, nothing is written), then started: crash recovery."""
    pm = postgres.running_cluster(h.services.postgres_dir)
    if pm is None:
        raise RuntimeError(f"no PostgreSQL runs from {h.services.postgres_dir}")
    os.kill(pm.pid, signal.SIGQUIT)
    if not wait_for(lambda: postgres.running_cluster(h.services.postgres_dir) is None, 15):
        raise RuntimeError(f"the postmaster {pm.pid} did not stop in immediate mode in 15 s")
    h.services.start_postgres()  # pg_ctl start -w: recovery, then it accepts connections
    return f"postmaster {pm.pid} stopped in immediate mode and started again"


def _crash_backend(h: Harness, conn: psycopg.Connection[TupleRow],
                   draw: float) -> str:
    """SIGKILL one client backend of the pipeline's database (one of this harness's
    postmaster's children): the postmaster ends every other backend and reinitialises,
    through crash recovery, without stopping itself. *conn* (a backend too) sees it end."""
    pm = postgres.running_cluster(h.services.postgres_dir)
    if pm is None:
        raise RuntimeError(f"no PostgreSQL runs from {h.services.postgres_dir}")
    rows = conn.execute(
        "SELECT pid, coalesce(nullif(application_name, ''), left(query, 40)) "
        "FROM pg_stat_activity WHERE backend_type = 'client backend' "
        "AND datname = current_database() AND pid <> pg_backend_pid() ORDER BY pid").fetchall()
    ours = [(int(pid), str(what)) for pid, what in rows if _parent(int(pid)) == pm.pid]
    if not ours:
        raise RuntimeError("no client backend of the harness's PostgreSQL to kill")
    pid, what = ours[min(int(draw * len(ours)), len(ours) - 1)]
    os.kill(pid, signal.SIGKILL)
    if not wait_for(lambda: _broken(conn), 15):
        raise RuntimeError(f"backend {pid} SIGKILLed, but the other backends lived on")
    return f"backend {pid} ({what!r}) SIGKILLed, every backend ended and recovered"


PROBES = 12  # messages emitted right after each restart, each in its own transaction


def _probe_topic(h: Harness) -> str:
    return f"{h.p.topic}.crash-probe"


def _emit_probes(h: Harness, crash: int, timeout_s: float) -> list[str]:
    """One message per transaction (one xid each) on the probe topic, keys spread over the
    lanes: the first transactions after a restart, so they get the first xids it issues."""
    assert h.engine is not None
    sent: list[str] = []
    deadline = time.monotonic() + timeout_s
    for k in range(PROBES):
        envelope = Envelope(topic=_probe_topic(h), type="crash.probe", key=f"c{crash}-{k}",
                            payload={"crash": crash, "n": k})
        while True:
            try:
                with h.engine.begin() as conn:
                    emit(conn, envelope)
                break
            except Exception:  # the server still recovering: the same message id again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        sent.append(str(envelope.message_id))
    return sent


def _check_probes(h: Harness, r: ScenarioResult, probes: list[str]) -> None:
    """Every committed probe message must be in Kafka (read from the topic, not from the
    outbox's status); the missing ones are lost messages like the orders'."""
    assert h.engine is not None
    assert r.findings is not None
    with h.engine.connect() as conn:
        committed = set(conn.execute(text(
            "SELECT message_id::text FROM outboxkit.outbox_messages "
            "WHERE topic = :t AND message_id::text = ANY(:ids)"),
            {"t": _probe_topic(h), "ids": probes}).scalars())
    seen: set[str] = set()
    deadline = time.monotonic() + 15  # the runs settled; the probes need no longer
    while True:
        seen = {d.message_id for d in read_topic(h.p.bootstrap, _probe_topic(h))}
        if committed <= seen or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    lost = sorted(committed - seen)
    r.findings.lost += lost
    r.notes.append(f"probe messages emitted right after the restarts: {len(committed)} "
                   f"committed, {len(committed & seen)} in Kafka, {len(lost)} lost")


def postgres_crash(crashes: int = 3) -> Scenario:
    """PostgreSQL crashes *crashes* times while orders flow, each time without a clean
    shutdown: the postmaster stopped in immediate mode and started again, or one backend
    SIGKILLed (the postmaster then restarts them all through crash recovery), the seed
    choosing. The database is back well within the relays' lane lease (3 s here), and each
    crash waits for the relays to renew after the previous one, so their lanes keep their
    fencing tokens and the relays their in-memory cursors.

    Right before each crash, transactions that take xids and leave their WAL in memory:
    rolled back, or committed with synchronous_commit off. Crash recovery issues those xids
    again. The relays are woken right after them (a NOTIFY), so their in-memory cursors are
    snapshots taken after them; a relay that kept such a cursor through the crash would count
    a new transaction given one of those xids as seen and never publish its row. So right
    after each restart, before the relays' first claim, the scenario emits probe messages
    (each in its own transaction, on a topic of their own), then seeds a wave of orders and
    waits until the agents emitted it. Every other crash comes once everything is published
    and settled (the relays idle, their cursors ahead of the stored ones, little flushing
    WAL), the others in the middle of a wave. The probes are checked in Kafka after the
    invariants: a committed probe missing there is lost.
    """
    probes: list[str] = []

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        if h.cluster is not None:
            raise RuntimeError("postgres-crash plays on the single PostgreSQL, not the cluster")
        probes.clear()
        _create_topic(h, _probe_topic(h))
        run_ids = h.seed_orders("postgres-crash-first")
        conn = _connect(h.p.database_url, 10)
        owners: list[dict[int, tuple[str, int]]] = []  # the lanes' (owner, token) before each
        try:
            for i in range(crashes):
                plan = _CrashPlan.draw(h, i)
                run_ids += _until_due(h, r, conn, plan, run_ids)
                owners.append(_tokens(conn))
                conn, did, burnt = _crash(h, conn, plan)
                r.kills += 1
                restarted_at = _next_xid(conn)
                probes.extend(_emit_probes(h, plan.n, 30))
                wave = seed_retrying(h, f"postgres-crash-after-{plan.n}", 30)
                run_ids += wave
                # Until the agents emitted the wave (they wait a second after losing the
                # database), before anything else takes the xids issued again.
                if not wait_for(lambda: _undecided(h, wave) == 0, 20):  # noqa: B023
                    r.notes.append(f"crash {plan.n}: the wave after it not emitted in 20 s")
                again = (f"xids {restarted_at}-{burnt - 1} issued again" if burnt > restarted_at
                         else f"no xid issued again (next {restarted_at}, {burnt} before)")
                r.notes.append(f"crash {plan.n} ({'idle' if plan.idle else 'busy'}): {did}; "
                               f"{plan.rolled_back} rolled back and {plan.committed} "
                               f"asynchronous commits just before: {again}")
            r.fault_ended = time.monotonic()
            time.sleep(2.5)  # a lease's worth of heartbeats after the last crash
            owners.append(_tokens(conn))
        finally:
            conn.close()
        moved = [sum(1 for lane, held in a.items() if b.get(lane) != held)
                 for a, b in itertools.pairwise(owners)]
        r.notes.append("lanes that changed owner or token across each crash: "
                       + ", ".join(map(str, moved)) + f" (of {len(owners[0])})")
        return run_ids

    return Scenario("postgres-crash", run, settle_s=60,
                    check=lambda h, r: _check_probes(h, r, probes))


@dataclass(frozen=True)
class _CrashPlan:
    """One crash of postgres-crash, drawn from the seed."""

    n: int  # 1, 2, ...
    idle: bool  # once everything settled, or in the middle of a wave
    how: str  # "immediate" (the postmaster) or "backend-kill"
    rolled_back: int
    committed: int  # with synchronous_commit off
    victim: float  # which backend, as a fraction of those there are
    busy_s: float  # a busy crash: how long after its wave
    pause_s: float  # from the NOTIFY that wakes the relays to the crash

    @classmethod
    def draw(cls, h: Harness, i: int) -> _CrashPlan:
        return cls(n=i + 1, idle=i % 2 == 0, how=h.rng.choice(["immediate", "backend-kill"]),
                   rolled_back=h.rng.randint(20, 60), committed=h.rng.randint(5, 20),
                   victim=h.rng.random(), busy_s=h.rng.uniform(0.3, 1.2),
                   pause_s=h.rng.uniform(0.03, 0.12))


def _until_due(h: Harness, r: ScenarioResult, conn: psycopg.Connection[TupleRow],
               plan: _CrashPlan, run_ids: list[uuid.UUID]) -> list[uuid.UUID]:
    """Wait for the crash's moment; return the runs seeded meanwhile."""
    seeded: list[uuid.UUID] = []
    if plan.idle:
        if not h.wait_final(run_ids, 20):
            r.notes.append(f"crash {plan.n}: the orders before it not settled")
    else:
        seeded = h.seed_orders(f"postgres-crash-busy-{plan.n}")
        time.sleep(plan.busy_s)
    since = _db_now(conn)
    if not wait_for(lambda: _lanes_steady(conn, h.names("relay"), since), 10):
        r.notes.append(f"crash {plan.n}: the relays' lanes not steady before it")
    return seeded


def _crash(h: Harness, conn: psycopg.Connection[TupleRow],
           plan: _CrashPlan) -> tuple[psycopg.Connection[TupleRow], str, int]:
    """Take xids that a crash forgets, wake the relays, crash; return a new connection once
    the database is back, what was done, and the next xid there was before the crash."""
    conn.execute(BURN_XIDS.format(rolled_back=plan.rolled_back, committed=plan.committed))
    burnt = _next_xid(conn)
    conn.execute("SELECT pg_notify(%s, 'postgres-crash')", (OutboxSettings().notify_channel,))
    time.sleep(plan.pause_s)  # the relays claim: their cursors count the xids above
    crashed = time.monotonic()
    try:
        if plan.how == "immediate":
            did = _crash_immediate(h)
        else:
            did = _crash_backend(h, conn, plan.victim)
    finally:
        conn.close()
        h.services.start_postgres()  # a no-op unless the crash failed halfway
    conn = _connect(h.p.database_url, 30)
    return conn, f"{did}; back in {time.monotonic() - crashed:.2f} s", burnt


def _create_topic(h: Harness, topic: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=h.p.bootstrap, client_id="faults-setup")
    try:
        if topic not in admin.list_topics():
            admin.create_topics([NewTopic(topic, 6, 1)])
    finally:
        admin.close()


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

        if not wait_for(escalated, 60):
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
        if not wait_for(lambda: any((o.get("request") or {}).get("item") == item
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


# --- worker-kills: agent workers running 8 steps at once, SIGKILLed mid-step --------------

WORKER_CONCURRENCY = 8
# Wait at most this long for the victims' steps to be in flight (a restarted agent included).
IN_FLIGHT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class _KillPlan:
    """One round of worker-kills, drawn from the seed before anything runs."""

    n: int  # 1, 2, ...
    victims: tuple[str, ...]  # one agent, or (the last round) every agent at once
    wave: int  # orders seeded at the round's start: more than the agents' slots
    target: int  # kill once each victim has this many steps stalled mid-step...
    delay_s: float  # ...and this long after


def _steps_in_flight(h: Harness, victims: tuple[str, ...], run_ids: list[uuid.UUID],
                     gone: set[tuple[str, int]]) -> dict[str, dict[str, tuple[int, bool]]]:
    """Per victim, the runs it holds under a live lease (its steps in flight): run id → (lease
    token, whether the step already wrote). A step's first write (its checkpoint) is an UPDATE
    of the claimed row in the step's open transaction: the committed version we read then has
    that transaction's id as xmax. Read without taking any lock. A restarted agent has its old
    name: the claims of its killed incarnation (*gone*: run id, lease token) hold their leases
    until they expire and are left out."""
    assert h.engine is not None
    with h.engine.connect() as db:
        rows = db.execute(text(
            "SELECT lease_owner, id::text, lease_token, xmax::text <> '0' "
            "FROM outboxkit.agent_runs WHERE id = ANY(:ids) AND state = 'running' "
            "AND lease_owner = ANY(:victims) AND lease_expires_at > now()"),
            {"ids": run_ids, "victims": list(victims)}).all()
    held: dict[str, dict[str, tuple[int, bool]]] = {v: {} for v in victims}
    for owner, run_id, token, wrote in rows:
        if (str(run_id), int(token)) not in gone:
            held[str(owner)][str(run_id)] = (int(token), bool(wrote))
    return held


def _until_in_flight(h: Harness, plan: _KillPlan, run_ids: list[uuid.UUID],
                     gone: set[tuple[str, int]], stall_s: float) -> bool:
    """Until each victim has *plan.target* steps stalled mid-step (written), or at least 2
    for half a stall already (as many as there will be: the first ones would finish)."""
    first_two: float | None = None  # when every victim first had 2

    def due() -> bool:
        nonlocal first_two
        held = _steps_in_flight(h, plan.victims, run_ids, gone)
        wrote = min(sum(w for _, w in held[v].values()) for v in plan.victims)
        if wrote >= 2 and first_two is None:
            first_two = time.monotonic()
        return wrote >= plan.target or (
            first_two is not None and time.monotonic() - first_two > stall_s / 2)

    return wait_for(due, IN_FLIGHT_TIMEOUT_S)


def _starts(h: Harness, name: str) -> int:
    """How many times agent *name* has started its worker (its log's start lines)."""
    path = h.p.workdir / f"{name}.log"
    text_ = path.read_text(errors="replace") if path.exists() else ""
    return text_.count(f"worker {name} starting:")


def _wait_started(h: Harness, before: dict[str, int], r: ScenarioResult) -> None:
    """Until every agent in *before* logged one more start (its claim loop runs): a wave
    seeded earlier would all go to the agents already up."""
    if not wait_for(lambda: all(_starts(h, n) > c for n, c in before.items()), 30):
        r.error = r.error or f"{', '.join(before)} not started again within 30 s"


def worker_kills(rounds: int = 3) -> Scenario:
    """The agent workers run 8 steps at once (``OUTBOXKIT_WORKER_CONCURRENCY=8``), each step
    stalled inside the step function for 0.8-1.4 s (``outbox.after_checkpoint=sleep(MS)``:
    its checkpoint is written in the step's transaction, its ``order.submit`` message and the
    move to ``waiting`` not yet). Each round seeds a wave of orders, waits until the round's
    victims (one agent; in the last round every agent at once) each have several steps stalled
    mid-step, reads which runs each holds, SIGKILLs it and restarts it, armed the same way.

    Afterwards, from the database: which of the steps in flight at each kill never committed
    (no move to ``waiting`` under that claim's lease token: they were interrupted), how many of
    those had already written; that each interrupted run was claimed again after its lease
    expired (resumed); that every run committed its step's effect once (one ``order.submit``
    message, one move to ``waiting``) and ended ``done``. The harness's invariants add the
    rest (nothing lost, one supplier order per run)."""
    scenario = Scenario(f"worker-kills:{rounds}", lambda h, r: [], settle_s=90)
    kills: list[tuple[int, str, dict[str, tuple[int, bool]]]] = []  # (round, victim, held)

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        kills.clear()
        agents = tuple(h.names("agent"))
        stall_ms = h.rng.randint(800, 1400)
        plans = [_KillPlan(
            n=i + 1,
            victims=agents if i == rounds - 1 else (h.rng.choice(agents),),
            wave=len(agents) * WORKER_CONCURRENCY + h.rng.randint(0, WORKER_CONCURRENCY),
            target=h.rng.randint(2, WORKER_CONCURRENCY),
            delay_s=h.rng.uniform(0.0, 0.3)) for i in range(rounds)]
        spec = f"outbox.after_checkpoint=sleep({stall_ms});seed={h.seed}"
        r.notes.append(f"agents at concurrency {WORKER_CONCURRENCY}, every step stalled "
                       f"{stall_ms} ms after its checkpoint write ({spec})")
        h.p.overrides["agent"] = {"OUTBOXKIT_WORKER_CONCURRENCY": str(WORKER_CONCURRENCY)}
        up = {name: _starts(h, name) for name in agents}
        for name in agents:
            h.p.stop(name)  # SIGTERM: its in-flight steps finish; not one of the kills
            h.p.restart(name, failpoints=spec)
        run_ids: list[uuid.UUID] = []
        gone: set[tuple[str, int]] = set()  # (run id, lease token) claimed by a killed agent
        for plan in plans:
            _wait_started(h, up, r)
            run_ids += h.seed_orders(f"worker-kills-{plan.n}", [
                f"worker-kills-{plan.n}-item-{i}" for i in range(plan.wave)])
            if not _until_in_flight(h, plan, run_ids, gone, stall_ms / 1000):
                r.error = r.error or (f"round {plan.n}: {', '.join(plan.victims)} never had 2 "
                                      f"steps in flight in {IN_FLIGHT_TIMEOUT_S:.0f} s")
            time.sleep(plan.delay_s)
            held = _steps_in_flight(h, plan.victims, run_ids, gone)
            up = {victim: _starts(h, victim) for victim in plan.victims}
            for victim in plan.victims:
                h.p.kill(victim)
            # Dead now: whatever they hold is theirs, claimed in the moment before the kill too.
            after = _steps_in_flight(h, plan.victims, run_ids, gone)
            held = {v: {**after[v], **held[v]} for v in plan.victims}
            for victim in plan.victims:
                r.kills += 1
                kills.append((plan.n, victim, held[victim]))
                gone.update((rid, token) for rid, (token, _) in held[victim].items())
                h.p.restart(victim, failpoints=spec)
            r.notes.append(f"round {plan.n}: {plan.wave} orders; SIGKILLed " + ", ".join(
                f"{v} holding {len(held[v])} claimed runs "
                f"({sum(w for _, w in held[v].values())} of their steps past the checkpoint "
                "write)" for v in plan.victims))
        for name in agents:  # disarm: the stalled steps finish, then a clean restart
            h.p.stop(name)
            h.p.restart(name)
        r.fault_ended = time.monotonic()
        scenario.expect = dict.fromkeys(run_ids, "done")
        return run_ids

    def restore(h: Harness) -> None:
        h.p.overrides.pop("agent", None)
        for name in h.names("agent"):
            h.p.stop(name)
            h.p.restart(name)

    def check(h: Harness, r: ScenarioResult) -> None:
        assert h.engine is not None
        assert r.findings is not None
        run_ids = list(scenario.expect or {})
        with h.engine.connect() as db:
            history = db.execute(text(
                "SELECT run_id::text, to_state, step, lease_token, reason "
                "FROM outboxkit.run_transitions WHERE run_id = ANY(:ids) ORDER BY id"),
                {"ids": run_ids}).all()
            submits = {str(run_id): int(n) for run_id, n in db.execute(text(
                "SELECT run_id::text, count(*) FROM outboxkit.outbox_messages "
                "WHERE run_id = ANY(:ids) AND message_type = 'order.submit' GROUP BY run_id"),
                {"ids": run_ids}).all()}
        committed: dict[str, set[int]] = {}  # run → lease tokens its step committed under
        resumed: dict[str, list[int]] = {}  # run → lease tokens of claims after an expiry
        decided: dict[str, int] = {}  # run → moves to waiting (the step's commit)
        for run_id, to_state, step, token, reason in history:
            if to_state == "waiting" and step == "order-submitted":
                committed.setdefault(run_id, set()).add(int(token))
                decided[run_id] = decided.get(run_id, 0) + 1
            if to_state == "running" and str(reason).startswith("lease expired, resumed by"):
                resumed.setdefault(run_id, []).append(int(token))
        per_kill: list[dict[str, Any]] = []
        interrupted_runs: dict[str, int] = {}  # run → times one of its steps was interrupted
        for n, victim, held in kills:
            cut = {rid: t for rid, (t, _) in held.items() if t not in committed.get(rid, ())}
            mid = [rid for rid in cut if held[rid][1]]
            per_kill.append({"round": n, "victim": victim, "in_flight": len(held),
                             "written": sum(w for _, w in held.values()),
                             "interrupted": len(cut), "interrupted_after_write": len(mid)})
            for rid, token in cut.items():
                interrupted_runs[rid] = interrupted_runs.get(rid, 0) + 1
                if not any(t > token for t in resumed.get(rid, [])):
                    r.unexpected.append(f"run {rid}: its step under lease {token} was "
                                        f"interrupted by the kill of {victim}, never resumed")
            if len(mid) < 2:
                r.unexpected.append(f"round {n}: the kill of {victim} interrupted {len(mid)} "
                                    "steps mid-step (wanted at least 2 in flight)")
        for run_id in map(str, run_ids):
            sent = int(submits.get(run_id, 0))
            if sent > 1:  # the step's effect committed twice: a double effect
                r.findings.double_effects.append(f"{run_id} (order.submit x{sent})")
            elif sent == 0:
                r.unexpected.append(f"run {run_id}: no order.submit committed")
            if decided.get(run_id, 0) != 1:
                r.unexpected.append(f"run {run_id}: its step committed "
                                    f"{decided.get(run_id, 0)} times (moves to waiting)")
        log_lines = [(h.p.workdir / f"{n}.log").read_text(errors="replace").count(
            f"concurrency {WORKER_CONCURRENCY}") for n in h.names("agent")]
        if min(log_lines, default=0) == 0:
            r.unexpected.append(f"an agent never started at concurrency {WORKER_CONCURRENCY}")
        interrupted = [k["interrupted"] for k in per_kill]
        r.figures = {"kills": per_kill, "summary": {
            "steps interrupted per kill": interrupted,
            "of them after their checkpoint write":
                [k["interrupted_after_write"] for k in per_kill],
            "runs interrupted (twice or more)":
                f"{len(interrupted_runs)} ({sum(c > 1 for c in interrupted_runs.values())})",
            "resumed after the lease expired": sum(1 for rid in interrupted_runs
                                                   if resumed.get(rid)),
            "order.submit per run (min, max)":
                [min((int(submits.get(str(i), 0)) for i in run_ids), default=0),
                 max((int(submits.get(str(i), 0)) for i in run_ids), default=0)],
        }}

    scenario.run, scenario.after, scenario.check = run, restore, check
    return scenario


def ci_subset(outage_s: float = 20.0) -> list[Scenario]:
    """Every failpoint once, a few random kills, one broker outage, a PostgreSQL restart
    and crashes, the supplier's paths, and agent workers at concurrency 8 SIGKILLed mid-step:
    the part that runs in the normal test command."""
    return [
        supplier_paths(),
        status_down(),
        *(failpoint(name) for name in FAILPOINTS if name in FAILPOINT_KIND),
        random_kills(4),
        postgres_restart(),
        postgres_crash(),
        broker_outage(outage_s),
        hanging_call(30.0),
        worker_kills(3),  # last: the scenarios before it draw the same plans from the seed
    ]


def full(outage_s: float, kill_rounds: int = 10) -> list[Scenario]:
    """Every scenario of the supplier-order pipeline; the soak passes more kill rounds
    (``python -m tests.faults`` adds the saga's, :mod:`tests.faults.saga`)."""
    return [*ci_subset(outage_s), random_kills(kill_rounds), scale_out(kill_rounds),
            hanging_call(60.0),  # the ledger's default in-flight grace
            worker_kills(5)]
