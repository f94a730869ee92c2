"""Lane ownership between relays, on the real PostgreSQL."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox.db.queries import driver_sql
from relay.claims import claim_messages
from relay.lanes import LaneManager
from tests.integration.relay_support import pool_of


def manager(engine: Engine, relay_id: str, lease: float = 3.0) -> LaneManager:
    return LaneManager(pool_of(engine), schema="outboxkit", relay_id=relay_id, lanes=64,
                       lease_seconds=lease, host="test", pid=1)


def settle(*managers: LaneManager) -> None:
    """A few heartbeat rounds, giving back excess lanes between them like the loop does."""
    for _ in range(3):
        for m in managers:
            m.heartbeat()
            m.release_pending()


def test_a_lone_relay_owns_every_lane(engine: Engine) -> None:
    a = manager(engine, "a")
    settle(a)
    assert sorted(a.owned()) == list(range(64))


def test_lanes_are_shared_fairly_and_never_owned_twice(engine: Engine) -> None:
    a, b, c = manager(engine, "a"), manager(engine, "b"), manager(engine, "c")
    settle(a)
    settle(a, b)
    assert len(a.owned()) == 32
    assert len(b.owned()) == 32
    settle(a, b, c)
    owned = [set(m.owned()) for m in (a, b, c)]
    assert sorted(len(o) for o in owned) == [20, 22, 22]
    assert set.union(*owned) == set(range(64))
    assert sum(len(o) for o in owned) == 64  # disjoint


def test_a_relay_that_leaves_hands_its_lanes_to_the_others(engine: Engine) -> None:
    a, b = manager(engine, "a"), manager(engine, "b")
    settle(a, b)
    b.leave()
    settle(a)
    assert sorted(a.owned()) == list(range(64))


def test_a_dead_relays_lanes_move_after_its_lease_expires_with_a_new_token(
    engine: Engine
) -> None:
    a, b = manager(engine, "a", lease=1.0), manager(engine, "b", lease=1.0)
    settle(a, b)
    dead = dict(b.owned())
    time.sleep(1.2)  # b stops heartbeating: its lease runs out
    settle(a)
    assert sorted(a.owned()) == list(range(64))
    for lane, old_token in dead.items():
        assert a.owned()[lane] > old_token


def test_a_stale_owner_claims_nothing_from_a_lane_taken_over(engine: Engine) -> None:
    a, b = manager(engine, "a", lease=1.0), manager(engine, "b", lease=1.0)
    settle(a)
    stale = dict(a.owned())  # a pauses (GC, network) while holding these tokens
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.outbox_messages (message_id, topic, key, lane, message_type,"
            " payload) SELECT gen_random_uuid(), 't', 'k', g % 64, 't', '\\x00'"
            " FROM generate_series(1, 128) g"))
    time.sleep(1.2)
    settle(b)
    with pool_of(engine).connection() as conn:
        assert claim_messages(conn, "outboxkit", relay_id="a", cursors=stale, limit=1000).rows == []
        rows = claim_messages(conn, "outboxkit", relay_id="b", cursors=b.owned(), limit=1000).rows
        assert len(rows) == 128


def test_a_database_error_in_a_claim_is_a_driver_error_on_a_sound_connection(
    engine: Engine,
) -> None:
    # The relay's loop backs off on psycopg.Error (relay.daemon.error_source): any other
    # exception would count as a bug.
    with pool_of(engine).connection() as conn:
        with pytest.raises(psycopg.Error, match="no_such_schema"):
            claim_messages(conn, "no_such_schema", relay_id="a", cursors={0: 1}, limit=10)
        assert not conn.broken  # a statement error, not a lost connection


def test_a_heartbeat_in_flight_when_the_relay_leaves_does_not_bring_it_back(
    engine: Engine,
) -> None:
    """Shutdown stops the scheduler without waiting; its heartbeat may still be running."""
    a, b = manager(engine, "a"), manager(engine, "b")
    settle(a, b)
    beat = threading.Thread(target=b.heartbeat, name="beat")
    leave = threading.Thread(target=b.leave)
    # The heartbeat stops at its registration: another transaction holds b's relays row.
    with engine.connect() as holder:
        holder.execute(text("SELECT 1 FROM outboxkit.relays WHERE relay_id = 'b' FOR UPDATE"))
        try:
            beat.start()
            waiting = text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                           "'Lock' AND query LIKE 'INSERT INTO outboxkit.relays %'")
            deadline = time.monotonic() + 10
            with engine.connect() as watch:
                while not watch.execute(waiting).scalar_one():
                    assert time.monotonic() < deadline, "the heartbeat did not reach the lock"
                    time.sleep(0.02)
                    watch.rollback()  # a fresh snapshot of pg_stat_activity
            leave.start()
            leave.join(0.5)
            assert leave.is_alive(), "leave did not wait for the heartbeat in flight"
        finally:
            holder.rollback()
            for thread in (beat, leave):
                thread.join(10)
    b.heartbeat()  # a scheduler tick after leaving changes nothing either
    with engine.connect() as conn:
        relays = conn.execute(text("SELECT relay_id FROM outboxkit.relays")).scalars().all()
        owners = conn.execute(
            text("SELECT DISTINCT owner FROM outboxkit.relay_lanes WHERE owner IS NOT NULL")
        ).scalars().all()
    assert relays == ["a"]
    assert owners == ["a"]


def test_declaring_itself_idle_does_not_make_a_relay_look_alive(engine: Engine) -> None:
    """Only the heartbeat that renews its leases says a relay lives, or a dead one is counted."""
    a = manager(engine, "a")
    settle(a)
    read = text("SELECT heartbeat_at FROM outboxkit.relays WHERE relay_id = 'a'")
    with engine.connect() as conn:
        beat = conn.execute(read).scalar_one()
    time.sleep(0.05)
    for idle in (True, False):
        with pool_of(engine).begin() as conn:
            conn.execute(driver_sql("relay", "set_idle", "outboxkit"),
                         {"idle": idle, "relay_id": "a"})
    with engine.connect() as conn:
        assert conn.execute(read).scalar_one() == beat


def test_a_heartbeat_says_when_a_silent_relays_lanes_run_out(engine: Engine) -> None:
    a, b = manager(engine, "a"), manager(engine, "b")
    settle(a, b)
    assert a.heartbeat().others_expire_in is None  # b renews in time: nothing to watch
    silent = set(b.owned())
    time.sleep(1.5)  # b misses a renewal (a third of its 3 s lease)
    beat = a.heartbeat()
    assert beat.others_expire_in is not None
    assert 0 < beat.others_expire_in <= 1.5
    time.sleep(beat.others_expire_in + 0.05)
    taken = a.heartbeat()  # at that moment b no longer counts, and its lanes are free
    assert sorted(taken.tokens) == list(range(64))
    assert taken.acquired == silent
