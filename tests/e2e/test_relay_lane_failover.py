"""A killed relay's lanes are owned again as soon as its lease runs out, not a heartbeat later."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text

from outbox.messages.envelope import Envelope
from tests.e2e.conftest import RelayProcesses, count_status, emit_batch, wait_until

LEASE = 6.0
HEARTBEAT = LEASE / 3  # the relay renews its lanes every third of a lease
SLACK = 0.8  # scheduling and one heartbeat transaction on a busy machine


def lanes_of(engine: Engine) -> dict[str, list[int]]:
    """Lanes each relay holds an unexpired lease on."""
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT owner, array_agg(lane ORDER BY lane) AS lanes FROM outboxkit.relay_lanes"
            " WHERE owner IS NOT NULL AND expires_at > clock_timestamp() GROUP BY owner"
        )).all()
    return {owner: list(lanes) for owner, lanes in rows}


def lease_end(engine: Engine, relay_id: str) -> tuple[float, float]:
    """When *relay_id*'s leases run out (epoch seconds), and in how many seconds from now."""
    with engine.connect() as conn:
        end, remaining = conn.execute(text(
            "SELECT extract(epoch FROM max(expires_at)),"
            " extract(epoch FROM max(expires_at) - clock_timestamp())"
            " FROM outboxkit.relay_lanes WHERE owner = :r"
        ), {"r": relay_id}).one()
    return float(end), float(remaining)


def renewed_after(engine: Engine, relay_id: str, end: float) -> Callable[[], bool]:
    return lambda: lease_end(engine, relay_id)[0] > end + 0.5


@pytest.mark.timeout(120)
def test_a_killed_relays_lanes_are_owned_again_when_its_lease_runs_out(
    engine: Engine, relays: RelayProcesses
) -> None:
    topic = f"failover-{uuid.uuid4().hex[:8]}"
    names = ["r0", "r1", "r2"]
    for name in names:
        relays.start(name, lane_lease_seconds=LEASE)
    procs = dict(zip(names, relays.procs, strict=True))
    stop = threading.Event()

    def load() -> None:
        # A trickle over many keys: every relay keeps going idle and busy again, which is
        # when the old code refreshed its heartbeat without renewing its lanes.
        i = 0
        while not stop.is_set():
            emit_batch(engine, [Envelope(topic=topic, type="t", key=f"k{i % 97}", payload={})])
            i += 1
            time.sleep(0.02)

    writer = threading.Thread(target=load)
    writer.start()
    try:
        def shared() -> bool:
            held = lanes_of(engine)
            return len(held) == 3 and sum(map(len, held.values())) == 64 and min(
                map(len, held.values())) >= 20

        wait_until(shared, 60, "three relays sharing the 64 lanes")
        wait_until(lambda: count_status(engine, "published") > 50, 60, "publishing")
        victim = "r1"
        owned = set(lanes_of(engine)[victim])
        # Kill it late in its renewal cycle: its leases then run out well before a whole
        # lease after the kill, and a survivor that waits for anything else is seen late.
        for _ in range(5):
            wait_until(renewed_after(engine, victim, lease_end(engine, victim)[0]), 30,
                       "a renewal")
            time.sleep(HEARTBEAT * 0.7)
            remaining = lease_end(engine, victim)[1]
            if remaining < LEASE - HEARTBEAT / 2:  # no renewal came in between
                break
        else:
            raise AssertionError("could not time the kill late in the victim's renewal cycle")
        killed = time.monotonic()
        relays.kill(procs[victim])

        def taken_over() -> bool:
            held = lanes_of(engine)
            return victim not in held and owned <= set().union(*held.values())

        wait_until(taken_over, LEASE * 3, "the survivors to own the victim's lanes")
        moved_after = time.monotonic() - killed
    finally:
        stop.set()
        writer.join()
    # The goal: within the lease plus one heartbeat of the kill...
    assert moved_after <= LEASE + HEARTBEAT + SLACK, moved_after
    # ...and, sharper, when the victim's own lease ran out: the survivors neither count it
    # live past its lanes' expiry nor wait for their next interval heartbeat to look.
    assert moved_after <= remaining + SLACK, (moved_after, remaining)
    wait_until(lambda: count_status(engine, "pending") == 0, 60, "the backlog to drain")
