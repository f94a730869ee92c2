"""Network faults between the pipeline's processes and its services, played through Toxiproxy
on the proxied harness (``python -m tests.faults --network``; :mod:`tests.faults.network`).

* ``net-partition:<path>``: a path cut for a while (its proxies disabled: connections closed,
  new ones refused) while orders keep being seeded, then healed;
* ``net-slow:<path>``: 500 ms ± 200 ms of latency and a bandwidth cap on a path, under load;
* ``net-half-open:<service>``: one process of each kind keeps its connections, but nothing
  goes through them any more, nor closes them (a ``timeout`` toxic of 0 ms on both
  directions): how long each takes to notice, against its configured timeouts;
* ``net-relay-fenced``: one relay cut from PostgreSQL (not from Kafka) right after Kafka
  acknowledged a batch, until its lanes' lease ran out and the other relay took them: its
  late record of the batch must be fenced; the batch is published twice, in key order.

After each, the harness's invariants (nothing lost, no effect twice, per-key order, every
run settled) and the scenario's figures: how soon after the heal publishing resumed and the
backlog was published, what the fault did to latencies, who noticed what and when.
"""

from __future__ import annotations

import functools
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from sqlalchemy import text

from outbox.db.dsn import CONNECT_DEFAULTS
from outbox.kafka.api import REQUEST_TIMEOUT_MS
from outbox.settings import OutboxSettings
from relay.daemon import SLOW_ACKS_SECONDS
from tests.faults.harness import Harness, ScenarioResult
from tests.faults.network import kafka_proxy, pg_proxy
from tests.faults.scenarios import Scenario, wait_for

RESUME_GOAL_S = 10.0  # publishing resumes within this long after a partition heals

# Which processes each path's proxies serve.
PATHS: dict[str, tuple[str, tuple[str, ...]]] = {  # path → (service, process kinds)
    "relay-kafka": ("kafka", ("relay",)),
    "consumer-kafka": ("kafka", ("consumer",)),
    "workers-pg": ("pg", ("agent", "consumer")),
    "consumer-pg": ("pg", ("consumer",)),
}


def _proxies(h: Harness, path: str) -> list[str]:
    service, kinds = PATHS[path]
    names = [n for kind in kinds for n in h.network.of(kind)]
    return [kafka_proxy(n) if service == "kafka" else pg_proxy(n) for n in names]


def _db_now(h: Harness) -> datetime:
    assert h.engine is not None
    with h.engine.connect() as conn:
        now = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
    assert isinstance(now, datetime)
    return now


def _load(h: Harness, tag: str, until: float, *, every_s: float = 2.0, wave: int = 3,
          tick: Callable[[], None] | None = None) -> list[uuid.UUID]:
    """Seed a small wave of orders every *every_s* until *until* (monotonic), calling *tick*
    every quarter second meanwhile."""
    run_ids: list[uuid.UUID] = []
    n, next_wave = 0, 0.0
    while time.monotonic() < until:
        if time.monotonic() >= next_wave:
            run_ids += h.seed_orders(f"{tag}-{n}", [f"{tag}-{n}-item-{i}" for i in range(wave)],
                                     accounts=16)
            n, next_wave = n + 1, time.monotonic() + every_s
        if tick is not None:
            tick()
        time.sleep(0.25)
    return run_ids


def _seconds(value: Any) -> float | None:
    return None if value is None else round(float(value), 2)


# Each message of the runs :ids with its commit time and its FIRST publish (the broker's
# proof in deliveries; a message published twice has two, and message_status shows the last).
FIRSTS = (
    "WITH firsts AS (SELECT m.id, m.created_at, min(p.published_at) AS published_at "
    "FROM outboxkit.outbox_messages AS m "
    "LEFT JOIN outboxkit.published_messages AS p ON p.id = m.id "
    "WHERE m.run_id = ANY(:ids) GROUP BY m.id, m.created_at) ")


def after_heal(h: Harness, healed: datetime, run_ids: list[uuid.UUID]) -> dict[str, Any]:
    """From the database's records: how soon after *healed* the first batch was published
    (by any relay), the messages committed before the heal and still unpublished then were
    all published, and the first of *run_ids* got its effect (done)."""
    assert h.engine is not None
    with h.engine.connect() as conn:
        first = conn.execute(text(
            "SELECT extract(epoch FROM min(published_at) - :t) FROM outboxkit.deliveries "
            "WHERE published_at >= :t"), {"t": healed}).scalar_one()
        pending, drained = conn.execute(text(
            FIRSTS + "SELECT count(*), extract(epoch FROM max(published_at) - :t) FROM firsts "
            "WHERE created_at < :t AND (published_at IS NULL OR published_at >= :t)"),
            {"t": healed, "ids": run_ids}).one()
        done = conn.execute(text(
            "SELECT extract(epoch FROM min(at) - :t) FROM outboxkit.run_transitions "
            "WHERE run_id = ANY(:ids) AND to_state = 'done' AND at >= :t"),
            {"t": healed, "ids": run_ids}).scalar_one()
    return {"publish resumed after heal (s)": _seconds(first),
            "unpublished at heal": int(pending),
            "all of them published after heal (s)": _seconds(drained) if pending else 0.0,
            "first effect after heal (s)": _seconds(done)}


def latencies(h: Harness, run_ids: list[uuid.UUID]) -> dict[str, Any]:
    """Of *run_ids*: seconds from commit to publish per message, from queued to done per run
    (median, max)."""
    assert h.engine is not None
    with h.engine.connect() as conn:
        publish = [float(v) for v in conn.execute(text(
            FIRSTS + "SELECT extract(epoch FROM published_at - created_at) FROM firsts "
            "WHERE published_at IS NOT NULL"), {"ids": run_ids}).scalars()]
        settle = [float(v) for v in conn.execute(text(
            "SELECT extract(epoch FROM max(at) FILTER (WHERE to_state = 'done') - min(at)) "
            "FROM outboxkit.run_transitions WHERE run_id = ANY(:ids) GROUP BY run_id "
            "HAVING bool_or(to_state = 'done')"), {"ids": run_ids}).scalars()]

    def shape(values: list[float]) -> list[float] | None:
        return [round(statistics.median(values), 2), round(max(values), 2)] if values else None

    return {"commit → publish s (median, max)": shape(publish),
            "queued → done s (median, max)": shape(settle)}


# What must start again after a path heals, by what the path carries.
RESUMES = {
    "relay-kafka": ("publish resumed after heal (s)",),
    "consumer-kafka": ("first effect after heal (s)",),
    "workers-pg": ("publish resumed after heal (s)", "first effect after heal (s)"),
}


def _goal(r: ScenarioResult, path: str, figures: dict[str, Any]) -> None:
    """What the path carries starts again within RESUME_GOAL_S of the heal (and a relay's
    backlog is all published by then); a miss is a failed expectation."""
    wanted = [*RESUMES[path], "all of them published after heal (s)"]
    got = {k: figures.get(k) for k in wanted}
    met = all(v is not None and v <= RESUME_GOAL_S for v in got.values())
    figures[f"goal: resumed ≤ {RESUME_GOAL_S:.0f} s after heal"] = met
    if not met:
        r.unexpected.append(f"after the heal: {got} (goal: each ≤ {RESUME_GOAL_S:.0f} s)")


def _members(h: Harness) -> set[str]:
    """The consumer group's member ids, as the broker has them (read directly)."""
    admin = KafkaAdminClient(bootstrap_servers=h.p.bootstrap, client_id="net-members")
    try:
        groups = admin.describe_groups([h.p.group])
        return {str(m["member_id"]) for g in groups.values() for m in g.get("members") or []}
    finally:
        admin.close()


def _rebuilds(h: Harness) -> int:
    return int(sum(h.p.metric(n, "outboxkit_consumer_client_rebuilds_total") or 0
                   for n in h.names("consumer")))


# --- partitions ---------------------------------------------------------------------------

def partition(path: str, seconds: float) -> Scenario:
    """Cut *path* for *seconds* under load (orders seeded every 2 s), then heal it."""
    scenario = Scenario(f"net-partition:{path}", lambda h, r: [], settle_s=120)
    state: dict[str, Any] = {}

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        proxies = _proxies(h, path)
        run_ids = h.seed_orders(f"part-{path}-before")
        time.sleep(2.0)
        not_ready: set[str] = set()
        rebuilds, members = _rebuilds(h), _members(h)

        def watch() -> None:
            not_ready.update(n for n in h.names("consumer") if not h.p.ready(n))

        for proxy in proxies:
            h.network.api.disable(proxy)
        r.notes.append(f"cut {', '.join(proxies)} for {seconds:.0f} s, orders seeded every 2 s")
        during = _load(h, f"part-{path}", time.monotonic() + seconds, tick=watch)
        healed = _db_now(h)
        h.network.heal()
        r.fault_ended = time.monotonic()
        ready_again = None
        if not_ready:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(h.p.ready(n) for n in h.names(
                    "consumer")):
                time.sleep(0.2)
            ready_again = round(time.monotonic() - r.fault_ended, 2)
        state.update(healed=healed, during=during, run_ids=[*run_ids, *during],
                     not_ready=sorted(not_ready), ready_again=ready_again, rebuilds=rebuilds,
                     members=members)
        return [*run_ids, *during]

    def check(h: Harness, r: ScenarioResult) -> None:
        figures = after_heal(h, state["healed"], state["run_ids"])
        figures.update(latencies(h, state["during"]))
        figures["consumers not ready during the cut"] = state["not_ready"]
        figures["consumers ready again after heal (s)"] = state["ready_again"]
        figures["consumer client rebuilds (watchdog)"] = _rebuilds(h) - state["rebuilds"]
        members = _members(h)
        figures["group members replaced (a rebalance)"] = (
            f"{len(state['members'] - members)} of {len(state['members'])}")
        figures["duplicates in Kafka"] = r.findings.duplicates_delivered if r.findings else None
        _goal(r, path, figures)
        r.figures = {"summary": figures}

    scenario.run, scenario.check = run, check
    return scenario


# --- latency and bandwidth ----------------------------------------------------------------

def slow(path: str, seconds: float, *, latency_ms: int = 500, jitter_ms: int = 200,
         kb_per_s: int = 16) -> Scenario:
    """*path* slowed for *seconds* under load: every chunk delayed *latency_ms* ±
    *jitter_ms* each way, and at most *kb_per_s* KB/s each way."""
    scenario = Scenario(f"net-slow:{path}", lambda h, r: [], settle_s=120)
    state: dict[str, Any] = {}

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        api = h.network.api
        before = h.seed_orders(f"slow-{path}-before")
        time.sleep(2.0)
        for proxy in _proxies(h, path):
            for stream in ("upstream", "downstream"):
                api.add_toxic(proxy, "latency", {"latency": latency_ms, "jitter": jitter_ms},
                              stream=stream, name=f"latency_{stream}")
                api.add_toxic(proxy, "bandwidth", {"rate": kb_per_s}, stream=stream,
                              name=f"bandwidth_{stream}")
        r.notes.append(f"{path}: {latency_ms} ± {jitter_ms} ms each way, {kb_per_s} KB/s "
                       f"each way, for {seconds:.0f} s under load")
        during = _load(h, f"slow-{path}", time.monotonic() + seconds)
        healed = _db_now(h)
        h.network.heal()
        r.fault_ended = time.monotonic()
        state.update(healed=healed, before=before, during=during)
        return [*before, *during]

    def check(h: Harness, r: ScenarioResult) -> None:
        figures = {f"before: {k}": v for k, v in latencies(h, state["before"]).items()}
        figures.update({f"slowed: {k}": v for k, v in latencies(h, state["during"]).items()})
        figures.update(after_heal(h, state["healed"], [*state["before"], *state["during"]]))
        figures["duplicates in Kafka"] = r.findings.duplicates_delivered if r.findings else None
        r.figures = {"summary": figures}

    scenario.run, scenario.check = run, check
    return scenario


# --- half-open connections ----------------------------------------------------------------

@dataclass
class _Watched:
    name: str
    kind: str
    log_mark: int  # the log's size when the fault began
    noticed_s: float | None = None
    how: str = ""
    stuck_s: float | None = None  # its scheduler said a job was still running
    working_after_heal: bool = False

    def figure(self) -> str:
        stuck = "" if self.stuck_s is None else f" (a job stuck from {self.stuck_s:.1f} s)"
        after = "; working again after the heal" if self.working_after_heal else (
            "; NOT working after the heal")
        if self.noticed_s is None:
            return f"never noticed{stuck}{after}"
        return f"{self.noticed_s:.1f} s{stuck}{after}: {self.how[:160]}"


def _new_lines(h: Harness, name: str, mark: int) -> list[str]:
    path: Path = h.p.workdir / f"{name}.log"
    try:
        with path.open("rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _log_size(h: Harness, name: str) -> int:
    path: Path = h.p.workdir / f"{name}.log"
    return path.stat().st_size if path.exists() else 0


# A warning or error in its log: it noticed something. The scheduler's "still running"
# lines are not noticing: they say a job hangs.
NOTICE = (" WARNING ", " ERROR ", "Traceback", "Error:")
STUCK = ("maximum number of running instances", "was missed by")


def _noticed(lines: list[str]) -> str:
    return next((line for line in lines if any(s in line for s in NOTICE)
                 and not any(s in line for s in STUCK)), "")


def _working(h: Harness, w: _Watched, healed: datetime, mark: int) -> bool:
    """Whether *w* works again after *healed*: a relay heartbeats, an agent moves a run, a
    consumer handles a message (its counter grew since *mark*), the reconciler's jobs are
    no longer reported stuck."""
    assert h.engine is not None
    with h.engine.connect() as conn:
        if w.kind == "relay":
            return bool(conn.execute(text(
                "SELECT count(*) FROM outboxkit.relays WHERE relay_id = :n "
                "AND heartbeat_at > :t"), {"n": w.name, "t": healed}).scalar_one())
        if w.kind == "agent":
            return bool(conn.execute(text(
                "SELECT count(*) FROM outboxkit.run_transitions WHERE actor = :n "
                "AND at > :t"), {"n": w.name, "t": healed}).scalar_one())
    if w.kind == "consumer":
        return (h.p.metric(w.name, "outboxkit_consumer_processed_total") or 0) > mark
    # The reconciler's job runs every half second: no "still running" line since *mark*.
    return not any(s in line for line in _new_lines(h, w.name, mark) for s in STUCK)


def half_open(service: str, hold_s: float) -> Scenario:
    """One process of each kind that talks to *service* ("pg" or "kafka") keeps its
    connections through the proxy, but nothing goes through any more either way and nothing
    closes them (new connections are accepted and hang the same way): a peer that died
    behind a middlebox, or a hung server. For up to *hold_s* under load, each is watched for
    the first sign that it noticed: a warning or error in its log, its exit, a consumer's
    readiness. Then the proxies heal and orders are seeded again; a process not working
    again 20 s later is stuck for good and is restarted (a finding)."""
    kinds = ("agent", "relay", "consumer", "reconciler") if service == "pg" else (
        "relay", "consumer")
    scenario = Scenario(f"net-half-open:{service}", lambda h, r: [], settle_s=120)
    state: dict[str, Any] = {}

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        api = h.network.api
        victims = [h.network.of(kind)[0] for kind in kinds]
        run_ids = h.seed_orders(f"half-{service}-before")
        time.sleep(2.0)
        watched = {n: _Watched(n, h.p.procs[n].kind, _log_size(h, n)) for n in victims}
        for name in victims:
            proxy = pg_proxy(name) if service == "pg" else kafka_proxy(name)
            api.timeout(proxy, 0, stream="upstream")
            api.timeout(proxy, 0, stream="downstream")
        began = time.monotonic()
        r.notes.append(f"half-open {service} for {', '.join(victims)}: up to {hold_s:.0f} s")

        def tick() -> None:
            for w in watched.values():
                lines = _new_lines(h, w.name, w.log_mark)
                if w.stuck_s is None and any(s in line for line in lines for s in STUCK):
                    w.stuck_s = round(time.monotonic() - began, 1)
                if w.noticed_s is not None:
                    continue
                how = ""
                if not h.p.procs[w.name].alive:
                    how = f"exited ({h.p.procs[w.name].popen.returncode})"
                elif w.kind == "consumer" and not h.p.ready(w.name):
                    how = "reports not ready (/readyz)"
                else:
                    how = _noticed(lines)
                if how:
                    w.noticed_s, w.how = round(time.monotonic() - began, 1), how

        def all_noticed() -> bool:
            return all(w.noticed_s is not None for w in watched.values())

        end = began + hold_s
        during: list[uuid.UUID] = []
        while time.monotonic() < end and not all_noticed():
            during += _load(h, f"half-{service}", min(end, time.monotonic() + 2.0), tick=tick)
        healed = _db_now(h)
        processed = {n: h.p.metric(n, "outboxkit_consumer_processed_total") or 0
                     for n in victims if h.p.procs[n].kind == "consumer"}
        h.network.heal()
        r.fault_ended = time.monotonic()
        after = _load(h, f"half-{service}-healed", time.monotonic() + 10.0, every_s=3.0)
        marks = {n: _log_size(h, n) for n in victims}  # 10 s after the heal
        after += _load(h, f"half-{service}-healed-2", time.monotonic() + 10.0, every_s=3.0)
        stuck = []
        for w in watched.values():
            mark = int(processed[w.name]) if w.kind == "consumer" else marks[w.name]
            w.working_after_heal = _working(h, w, healed, mark)
            if not w.working_after_heal and h.p.procs[w.name].alive:
                stuck.append(w.name)
        for name in stuck:
            h.p.restart(name)
            r.notes.append(f"finding: {name} was not working 20 s after the heal "
                           "(stuck on the connection that went silent): restarted")
        state.update(watched=watched, healed=healed, run_ids=[*run_ids, *during, *after],
                     during=during, stuck=stuck)
        return [*run_ids, *during, *after]

    def check(h: Harness, r: ScenarioResult) -> None:
        watched: dict[str, _Watched] = state["watched"]
        figures: dict[str, Any] = {f"{n} noticed after": w.figure() for n, w in watched.items()}
        figures["stuck for good: restarted 20 s after the heal"] = state["stuck"]
        figures["configured timeouts"] = configured_timeouts(service)
        figures.update(after_heal(h, state["healed"], state["run_ids"]))
        figures.update(latencies(h, state["during"]))
        figures["duplicates in Kafka"] = r.findings.duplicates_delivered if r.findings else None
        r.figures = {"summary": figures,
                     "noticed_s": {n: w.noticed_s for n, w in watched.items()},
                     "stuck_s": {n: w.stuck_s for n, w in watched.items()},
                     "how": {n: w.how for n, w in watched.items()},
                     "restarted": state["stuck"]}

    scenario.run, scenario.check = run, check
    return scenario


def configured_timeouts(service: str) -> str:
    """The settings that bound how long a client waits on a silent peer, as the harness
    runs them (tests/faults: leases of 3 s, consumer session timeout 6 s)."""
    if service == "pg":
        d = CONNECT_DEFAULTS
        return (f"libpq keepalives {d['keepalives_idle']}+{d['keepalives_interval']}"
                f"x{d['keepalives_count']} s (answered by the proxy's TCP stack, as by any "
                f"middlebox: they cannot see a hung peer), connect_timeout "
                f"{d['connect_timeout']} s, tcp_user_timeout {d.get('tcp_user_timeout', 0)} "
                "ms; relay lane lease 3 s, worker lease 3 s")
    return (f"relay: not ready after {SLOW_ACKS_SECONDS:.0f} s without an ack, producer "
            f"request_timeout_ms {REQUEST_TIMEOUT_MS}; consumer: request_timeout_ms "
            f"{REQUEST_TIMEOUT_MS}, session_timeout_ms 6000 (the harness's), watchdog after 2 "
            "session timeouts")


# --- a relay fenced after its lease ran out -----------------------------------------------

FENCED_LOG = "were not moved"  # relay.lanes_lost: the batch's record was fenced
STALL_MS = 8000


def relay_fenced(cut_s: float = 10.0, rounds: int = 2) -> Scenario:
    """relay-1 alone (relay-2 stopped, so relay-1 holds every lane) stalls right after Kafka
    acknowledged its first batch (``relay.after_ack=sleep``); meanwhile its path to
    PostgreSQL is cut (not its path to Kafka) for *cut_s*, longer than its lanes' lease
    (3 s), and relay-2 starts. relay-2 takes the lanes once the lease ran out and publishes
    the batch again; when the path heals, relay-1's late record of the batch must be refused
    (fenced by the lanes' tokens: its log says the lanes were not moved). Nothing lost,
    per-key order kept in Kafka (duplicates dropped), the duplicates counted."""
    scenario = Scenario("net-relay-fenced", lambda h, r: [], settle_s=120)
    state: dict[str, Any] = {}

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        api = h.network.api
        victim, other = h.network.of("relay")[:2]
        run_ids: list[uuid.UUID] = []
        fenced_rounds, took_over = 0, 0
        for n in range(rounds):
            h.p.stop(other)  # SIGTERM: it gives its lanes back
            mark = _log_size(h, victim)
            h.p.restart(victim, failpoints=f"relay.after_ack=sleep({STALL_MS})@1;seed={h.seed}")
            if not wait_for(lambda: _owned_by(h, victim) == _lanes(), 20):
                r.error = f"{victim} did not own every lane 20 s after its restart"
                break
            tokens = _lane_tokens(h)
            records = _records(h)
            run_ids += h.seed_orders(f"fenced-{n}", [f"fenced-{n}-item-{i}" for i in range(16)],
                                     accounts=32)
            # Its first batch reaches Kafka; then it stalls before recording it.
            if not wait_for(functools.partial(_more_records, h, records), 15):
                r.notes.append(f"round {n + 1}: {victim} published nothing within 15 s")
                continue
            api.disable(pg_proxy(victim))
            cut_at = _db_now(h)
            h.p.restart(other)
            wait_for(lambda: False, cut_s)
            healed = _db_now(h)
            api.enable(pg_proxy(victim))
            now = _lane_tokens(h)
            taken = [lane for lane, (owner, token) in now.items()
                     if owner == other and token > tokens.get(lane, ("", -1))[1]]
            took_over += bool(taken)
            said = wait_for(functools.partial(_said, h, victim, mark, FENCED_LOG), 20)
            fenced_rounds += said
            r.notes.append(f"round {n + 1}: {victim} cut from PostgreSQL for {cut_s:.0f} s "
                           f"after Kafka acked its batch; {other} took {len(taken)} lanes; "
                           f"{victim}'s late record {'fenced' if said else 'NOT seen fenced'}")
            state.update(healed=healed, cut=cut_at, victim=victim, other=other)
            if said:
                break
        r.fault_ended = time.monotonic()
        h.p.restart(victim)  # disarmed
        if not h.p.procs[other].alive:
            h.p.restart(other)
        state.update(run_ids=run_ids, fenced=fenced_rounds, took_over=took_over)
        if not fenced_rounds:
            r.unexpected.append(f"{victim}'s late record was never seen fenced in {rounds} "
                                "rounds")
        return run_ids

    def check(h: Harness, r: ScenarioResult) -> None:
        f = r.findings
        figures: dict[str, Any] = {
            "rounds with the late record fenced": state["fenced"],
            "rounds with the lanes taken over": state["took_over"],
            "duplicates in Kafka (published twice)": f.duplicates_delivered if f else None,
            "per-key order violations": len(f.order_violations) if f else None,
        }
        if "healed" in state:
            figures.update(_takeover(h, state))
        r.figures = {"summary": figures}

    scenario.run, scenario.check = run, check
    return scenario


def _takeover(h: Harness, state: dict[str, Any]) -> dict[str, Any]:
    """From the deliveries (the broker's proof, written by every record, fenced or not: only
    the lanes' cursors are fenced): when the other relay published the batch again, counted
    from the cut; and what the victim's late record held."""
    assert h.engine is not None
    with h.engine.connect() as conn:
        again = conn.execute(text(
            "SELECT extract(epoch FROM min(published_at) - :cut) FROM outboxkit.deliveries "
            "WHERE relay_id = :r AND published_at > :cut"),
            {"cut": state["cut"], "r": state["other"]}).scalar_one()
        late = conn.execute(text(
            "SELECT coalesce(sum(cardinality(ids)), 0), extract(epoch FROM min(published_at) - :t)"
            " FROM outboxkit.deliveries WHERE relay_id = :r AND published_at >= :t"),
            {"t": state["healed"], "r": state["victim"]}).one()
    return {f"{state['other']} published the batch again, after the cut (s)": _seconds(again),
            f"{state['victim']}'s late record: messages": int(late[0]),
            f"{state['victim']}'s late record, after the heal (s)": _seconds(late[1])}


def _more_records(h: Harness, than: int) -> bool:
    return _records(h) > than


def _said(h: Harness, name: str, mark: int, words: str) -> bool:
    return any(words in line for line in _new_lines(h, name, mark))


def _lanes() -> int:
    return OutboxSettings().lanes


def _lane_tokens(h: Harness) -> dict[int, tuple[str, int]]:
    assert h.engine is not None
    with h.engine.connect() as conn:
        rows = conn.execute(text("SELECT lane, owner, token FROM outboxkit.relay_lanes "
                                 "WHERE owner IS NOT NULL AND expires_at > now()")).all()
    return {int(lane): (str(owner), int(token)) for lane, owner, token in rows}


def _owned_by(h: Harness, relay: str) -> int:
    return sum(owner == relay for owner, _ in _lane_tokens(h).values())


def _records(h: Harness) -> int:
    """Records in the scenario topic (its partitions' end offsets, read directly)."""
    consumer = KafkaConsumer(bootstrap_servers=h.p.bootstrap, client_id="net-fenced")
    try:
        parts = [TopicPartition(h.p.topic, p)
                 for p in consumer.partitions_for_topic(h.p.topic) or ()]
        return int(sum(consumer.end_offsets(parts).values())) if parts else 0
    finally:
        consumer.close()


# --- the sets -----------------------------------------------------------------------------

@dataclass
class Lengths:
    partition_s: float = 30.0
    slow_s: float = 30.0
    half_open_s: float = 60.0
    extra: dict[str, float] = field(default_factory=dict)


def network_set(lengths: Lengths | None = None) -> list[Scenario]:
    """Every network scenario (``make faults`` plays them with ``--network``)."""
    n = lengths or Lengths()
    return [
        partition("relay-kafka", n.partition_s),
        partition("consumer-kafka", n.partition_s),
        partition("workers-pg", n.partition_s),
        slow("relay-kafka", n.slow_s),
        slow("consumer-pg", n.slow_s),
        half_open("pg", n.half_open_s),
        half_open("kafka", n.half_open_s),
        relay_fenced(),
    ]
