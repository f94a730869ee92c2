"""The cluster set: faults of production's topology (3 Kafka nodes, a PostgreSQL primary with
a synchronous standby), injected while orders and the publish probe flow.

Each scenario records its fault window (``fault_window``: time.time() of the first fault
and of the moment the cluster was whole again) so the runner can measure, from the probe's
broker append times, how long publishing stopped; and notes what it did and saw.
"""

from __future__ import annotations

import itertools
import signal
import time
import uuid
from collections import Counter

from examples.supplier_order.pipeline import PARTITIONS
from outbox.testing.kafka_cluster import KafkaCluster
from tests.faults.harness import Harness, ScenarioResult
from tests.faults.scenarios import Scenario, seed_retrying


def _k(h: Harness) -> KafkaCluster:
    assert h.cluster is not None, "a cluster scenario needs Harness(cluster=True)"
    return h.cluster.k


def _topics(h: Harness) -> list[tuple[str, int]]:
    assert h.probe is not None
    return [(h.p.topic, p) for p in range(PARTITIONS)] + [(h.probe.topic, 0)]


def _probe_leader(h: Harness) -> int:
    """The leader of the busiest partition: the probe's, written ~20 times a second."""
    assert h.probe is not None
    return _k(h).leader(h.probe.topic, 0)


def _leaders(h: Harness) -> dict[int, int]:
    """How many of the scenario topic's partitions each node leads."""
    return dict(Counter(_k(h).leader(t, p) for t, p in _topics(h)))


def _wait_in_sync(h: Harness, r: ScenarioResult, timeout_s: float = 90) -> float:
    """Until every replica of every partition is in sync again; returns the seconds."""
    started = time.monotonic()
    for topic, partition in _topics(h):
        _k(h).wait_in_sync(topic, partition, timeout_s=max(5.0, timeout_s - (
            time.monotonic() - started)))
    took = time.monotonic() - started
    r.notes.append(f"in sync {took:.1f} s later; leaders per node {_leaders(h)}")
    return took


def _end(r: ScenarioResult, started: float) -> None:
    r.fault_ended = time.monotonic()
    r.fault_window = (started, time.time())


def leader_kill(outage_s: float = 12.0) -> Scenario:
    """SIGKILL the leader of the busiest partition (the probe's; it leads others too) under
    relay + consumer load; restart it *outage_s* later; wait until every replica is in sync."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        run_ids = h.seed_orders("leader-kill-before")
        time.sleep(1.5)
        victim = _probe_leader(h)
        r.notes.append(f"node {victim} killed; it led {_leaders(h).get(victim, 0)} partitions")
        started = time.time()
        _k(h).kill(victim, signal.SIGKILL)
        r.kills += 1
        run_ids += h.seed_orders("leader-kill-during")
        time.sleep(outage_s)
        _k(h).restart(victim)
        _wait_in_sync(h, r)
        _end(r, started)
        return run_ids

    return Scenario("leader-kill", run, settle_s=150)


def leader_stop(hung_s: float = 20.0) -> Scenario:
    """SIGSTOP the leader of the busiest partition for *hung_s*: a broker that hangs (a GC
    pause, a frozen VM) with its connections open. The controller fences it after the broker
    session and moves its leaderships; the relay's requests already sent to it must time out
    (request_timeout_ms) rather than hold its batches until the node wakes. SIGCONT, resync."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        assert h.probe is not None
        run_ids = h.seed_orders("leader-stop-before")
        time.sleep(1.5)
        victim = _probe_leader(h)
        led = _leaders(h).get(victim, 0)
        started = time.time()
        _k(h).kill(victim, signal.SIGSTOP)
        r.kills += 1
        run_ids += h.seed_orders("leader-stop-during")
        time.sleep(hung_s)
        woke = time.time()
        _k(h).kill(victim, signal.SIGCONT)
        _wait_in_sync(h, r)
        _end(r, started)
        appended = [a.at for a in h.probe.appended()]
        after = [a for a in appended if a > started + 0.5]
        r.notes.append(
            f"node {victim} (leading {led} partitions) SIGSTOPped for {hung_s:.0f} s: "
            f"first probe append {after[0] - started:.2f} s after the stop"
            if after else f"node {victim} SIGSTOPped: no probe append after the stop")
        if after and after[0] >= woke:
            r.notes.append("publishing waited for the hung node to wake")
        return run_ids

    return Scenario("leader-stop", run, settle_s=150)


def controller_kill(outage_s: float = 8.0) -> Scenario:
    """SIGKILL the active KRaft controller (a broker too: it leads partitions); restart it."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        run_ids = h.seed_orders("controller-kill-before")
        time.sleep(1.5)
        victim = _k(h).active_controller()
        if victim < 0:
            raise RuntimeError("the quorum has no leader before the fault")
        r.notes.append(f"controller node {victim} killed (led {_leaders(h).get(victim, 0)} "
                       "partitions)")
        started = time.time()
        _k(h).kill(victim, signal.SIGKILL)
        r.kills += 1
        run_ids += h.seed_orders("controller-kill-during")
        deadline = time.monotonic() + 30
        new = -1
        while new < 0 and time.monotonic() < deadline:
            new = _k(h).active_controller()
            time.sleep(0.1)
        r.notes.append(f"new controller {new} after {time.time() - started:.1f} s")
        time.sleep(max(0.0, outage_s - (time.time() - started)))
        _k(h).restart(victim)
        _wait_in_sync(h, r)
        _end(r, started)
        return run_ids

    return Scenario("controller-kill", run, settle_s=150)


def _gap_inside(appended: list[float], since: float, until: float) -> float:
    """The longest stretch of [since, until] without a probe append, the window's own ends
    counting as ends: a gap that began before the window, or ends after it, is cut there,
    so a gap running across two phases is not reported as either's whole."""
    inside = [since, *(at for at in appended if since < at < until), until]
    return round(max(b - a for a, b in itertools.pairwise(inside)), 2)


def _gap_across(appended: list[float], at: float) -> tuple[float, float] | None:
    """Seconds from the last probe append before *at* to *at*, and from *at* to the first
    after it; None if there is none on one side."""
    before = [a for a in appended if a <= at]
    after = [a for a in appended if a > at]
    if not before or not after:
        return None
    return round(at - before[-1], 2), round(after[0] - at, 2)


def follower_stop(first_s: float = 16.0, second_s: float = 10.0) -> Scenario:
    """SIGSTOP a follower of the probe's partition for longer than replica.lag.time.max.ms
    (10 s here; it is also fenced after the 6 s broker session): the ISR shrinks and
    publishing goes on with 2. Then SIGSTOP the other follower: 1 left, below
    min.insync.replicas, so the relay must wait and lose nothing. SIGCONT both."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        assert h.probe is not None
        k = _k(h)
        run_ids = h.seed_orders("follower-stop-before")
        time.sleep(1.5)
        state = k.partition(h.probe.topic, 0)
        followers = [n for n in state.replicas if n != state.leader]
        controller = k.active_controller()
        # Not the active controller first when there is a choice: one fault at a time.
        followers.sort(key=lambda n: n == controller)
        first, second = followers[0], followers[1]
        led = _leaders(h)  # a relay's batch waits on any partition the stopped node leads
        started = time.time()
        k.kill(first, signal.SIGSTOP)
        r.kills += 1
        run_ids += h.seed_orders("follower-stop-one")
        time.sleep(first_s)
        isr = _isr_or_none(k, h.probe.topic)
        one_end = time.time()
        k.kill(second, signal.SIGSTOP)
        r.kills += 1
        run_ids += h.seed_orders("follower-stop-two")
        time.sleep(second_s)
        two_end = time.time()
        for node in (first, second):
            k.kill(node, signal.SIGCONT)
        _wait_in_sync(h, r, timeout_s=120)
        _end(r, started)
        appended = [a.at for a in h.probe.appended()]
        across = _gap_across(appended, one_end)
        resumed = _gap_across(appended, two_end)
        r.notes.append(
            f"leader {state.leader}, controller {controller}; SIGSTOP {first} (leading "
            f"{led.get(first, 0)} partitions) for {one_end - started:.0f} s (ISR then {isr}): "
            f"longest publish gap inside "
            f"{_gap_inside(appended, started, one_end)} s; then SIGSTOP {second} too for "
            f"{second_s:.0f} s: longest gap inside {_gap_inside(appended, one_end, two_end)} s"
            + (f"; last append {across[0]} s before the second SIGSTOP"
               if across and across[0] >= 1 else "")
            + (f"; publishing resumed {resumed[1]} s after SIGCONT" if resumed else ""))
        return run_ids

    return Scenario("follower-stop", run, settle_s=150)


def _isr_or_none(k: KafkaCluster, topic: str) -> tuple[int, ...] | None:
    try:
        return k.partition(topic, 0).isr
    except Exception:  # no live node answered: what we saw is the note
        return None


def rolling_restart() -> Scenario:
    """Each node in turn: SIGTERM (a controlled shutdown moves its leaderships), start it
    again, wait until every replica is in sync, then the next; orders flow throughout."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        k = _k(h)
        run_ids = h.seed_orders("rolling-before")
        time.sleep(1.0)
        started = time.time()
        for node in k.node_ids:
            step = time.monotonic()
            k.stop_node(node, grace_s=30)
            r.kills += 1
            run_ids += h.seed_orders(f"rolling-{node}")
            k.restart(node)
            _wait_in_sync(h, r)
            r.notes.append(f"node {node} restarted and in sync in {time.monotonic() - step:.1f} s")
        _end(r, started)
        return run_ids

    return Scenario("rolling-restart", run, settle_s=150)


def clients_killed_in_failover(outage_s: float = 12.0) -> Scenario:
    """Kill the probe's leader, then 1-2 s later SIGKILL a relay and a consumer and start
    them again while the partitions change leaders; restart the node later."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        k = _k(h)
        run_ids = h.seed_orders("clients-in-failover-before")
        time.sleep(1.5)
        victim = _probe_leader(h)
        started = time.time()
        k.kill(victim, signal.SIGKILL)
        r.kills += 1
        time.sleep(h.rng.uniform(1.0, 2.0))
        relay, consumer = h.rng.choice(h.names("relay")), h.rng.choice(h.names("consumer"))
        for name in (relay, consumer):
            h.p.kill(name)
            r.kills += 1
        r.notes.append(f"node {victim} killed, then {relay} and {consumer} "
                       f"{time.time() - started:.1f} s later")
        for name in (relay, consumer):
            h.p.restart(name)
        run_ids += h.seed_orders("clients-in-failover-during")
        time.sleep(max(0.0, outage_s - (time.time() - started)))
        k.restart(victim)
        _wait_in_sync(h, r)
        _end(r, started)
        return run_ids

    return Scenario("clients-killed-in-failover", run, settle_s=150)


def pg_failover() -> Scenario:
    """SIGKILL the PostgreSQL primary under load and promote the synchronous standby; every
    process must reconnect through the same URL without a restart (heal() counts any it had
    to make). Afterwards the old primary is rebuilt as the new primary's standby, so the
    next round can fail over again."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        assert h.cluster is not None
        run_ids = h.seed_orders("pg-failover-before")
        time.sleep(h.rng.uniform(1.0, 2.5))
        fo = h.cluster.fail_over()
        r.kills += 1
        r.notes.append(
            f"{fo.old_primary} SIGKILLed, port closed {fo.closed_at - fo.killed_at:.2f} s later,"
            f" {fo.new_primary} promoted {fo.promoted_at - fo.killed_at:.2f} s after the kill")
        run_ids += seed_retrying(h, "pg-failover-after", 30)
        _end(r, fo.killed_at)
        r.fault_window = (fo.killed_at, fo.promoted_at)
        return run_ids

    def rebuild(h: Harness) -> None:
        assert h.cluster is not None
        took = h.cluster.rebuild_standby()
        print(f"    standby rebuilt from the promoted node in {took:.1f} s", flush=True)

    return Scenario("pg-failover", run, settle_s=150, after=rebuild)


def cluster_set() -> list[Scenario]:
    """Every cluster scenario; the PostgreSQL failover last (its standby is rebuilt after)."""
    return [
        leader_kill(),
        leader_stop(),
        controller_kill(),
        follower_stop(),
        rolling_restart(),
        clients_killed_in_failover(),
        pg_failover(),
    ]
