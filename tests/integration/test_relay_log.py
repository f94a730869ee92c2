"""The outbox read as a log of snapshot differences (relay/claims.py, relay/cursors.py), on the
real PostgreSQL: late commits with low ids, transactions left open, several steps per
difference, per-key order under concurrent writers. The reader here does what the daemon does
between the database and Kafka (claim, move its cursors, record), with Kafka's answer taken as
"acknowledged": what is tested is which rows come out, in which order, and how often."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import defaultdict

from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from relay.claims import OutboxRow
from tests.integration.relay_support import Reader, put


def test_a_transaction_that_commits_late_with_a_lower_id_is_still_published(
    engine: Engine,
) -> None:
    reader = Reader(engine)
    with engine.connect() as late:
        late.begin()
        early_id = put(late, "a", 0)  # draws the lower id, commits last
        with engine.begin() as conn:
            later = [put(conn, "b", i) for i in range(3)]
        first = reader.drain()
        assert [r.message_id for r in first] == later
        late.commit()
    rows = reader.drain()
    assert [r.message_id for r in rows] == [early_id]
    assert rows[0].id < min(r.id for r in first)  # published after rows with higher ids
    assert reader.drain() == []
    with engine.connect() as conn:  # and the proof of all four is recorded
        assert conn.execute(text(
            "SELECT count(DISTINCT id) FROM outboxkit.published_messages")).scalar_one() == 4


def test_a_late_commit_inside_a_difference_published_in_steps_comes_out_once_in_id_order(
    engine: Engine,
) -> None:
    reader = Reader(engine, limit=100)
    with engine.connect() as late:
        late.begin()
        put(late, "a", 0)
        with engine.begin() as conn:
            for i in range(250):
                put(conn, f"k{i % 7}", i)
        first = reader.step()  # the difference is 250 rows; this is its first step
        assert len(first) == 100
        late.commit()  # now visible, but not in the difference being published
        rest = reader.drain()
    ids = [r.id for r in first + rest]
    assert len(ids) == len(set(ids)) == 251
    assert ids[:250] == sorted(ids[:250])  # the first difference in id order
    assert ids[250] < ids[0]  # the late row came in the next difference, lowest id of all


def test_an_open_transaction_holds_nothing_back(engine: Engine) -> None:
    """One transaction stays open with an outbox row, another with only an xid (no rows),
    while 20 rounds of other transactions commit: each round is read at once, whole."""
    reader = Reader(engine, limit=1000)
    with engine.connect() as holder, engine.connect() as idle:
        holder.begin()
        held = put(holder, "held", 0)
        idle.begin()
        idle.execute(text("SELECT pg_current_xact_id()"))
        started = time.monotonic()
        for round_ in range(20):
            with engine.begin() as conn:
                written = {put(conn, f"k{i}", i) for i in range(50)}
            got = reader.drain()
            assert {r.message_id for r in got} == written, f"round {round_}"
        assert time.monotonic() - started < 60
        holder.commit()
        idle.commit()
    assert [r.message_id for r in reader.drain()] == [held]


def test_each_key_comes_out_in_commit_order_under_concurrent_writers(engine: Engine) -> None:
    """Writers commit random transactions over a few keys (some rolled back, some held open a
    while) while the reader keeps draining in small steps: every committed row comes out once,
    and each key's rows in the order their transactions committed (id order, see emit)."""
    settings = OutboxSettings(lanes=4)
    reader = Reader(engine, lanes=4, limit=37)
    committed: dict[uuid.UUID, str] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            with engine.connect() as conn:
                conn.begin()
                keys = sorted(rng.sample(["a", "b", "c", "d", "e", "f"], rng.randint(1, 3)))
                ids = {put(conn, key, seed, settings): key for key in keys}
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 0.05)  # holds its key locks across reads
                if rng.random() < 0.1:
                    conn.rollback()
                    continue
                conn.commit()
            with lock:
                committed.update(ids)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    out: list[OutboxRow] = []
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        out += reader.step()
    stop.set()
    for t in threads:
        t.join()
    out += reader.drain()
    seen = [r.message_id for r in out]
    assert len(seen) == len(set(seen)), "a row came out twice"
    assert set(seen) == set(committed), "a committed row is missing (or a rolled-back one out)"
    by_key: dict[bytes | None, list[int]] = defaultdict(list)
    for r in out:
        by_key[r.key].append(r.id)
    for key, ids in by_key.items():
        assert ids == sorted(ids), f"key {key!r} out of commit order"
    assert len(out) > 100


def test_the_relay_never_updates_or_deletes_an_outbox_row(engine: Engine) -> None:
    with engine.begin() as conn:
        for i in range(300):
            put(conn, f"k{i % 10}", i, OutboxSettings())
    with engine.connect() as conn:
        before = conn.execute(text(
            "SELECT n_tup_upd, n_tup_del, n_tup_hot_upd FROM pg_stat_user_tables "
            "WHERE schemaname = 'outboxkit' AND relname = 'outbox_messages'")).one()
    assert len(Reader(engine, lanes=64, limit=100).drain()) == 300
    time.sleep(1.2)  # statistics reach the views within a second (PostgreSQL 15)
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        after = conn.execute(text(
            "SELECT n_tup_upd, n_tup_del, n_tup_hot_upd FROM pg_stat_user_tables "
            "WHERE schemaname = 'outboxkit' AND relname = 'outbox_messages'")).one()
    assert tuple(after) == tuple(before)
