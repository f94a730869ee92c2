"""What one claim takes and how its outcome is recorded (relay/claims.py), on the real
PostgreSQL: a lane's rows come as a whole prefix in id order however the claim's parts are
cut, and block mode decides a key's state from that key's own failure rows, at claim time and
again inside the record's transaction."""

from __future__ import annotations

import threading
import time

from sqlalchemy import Engine, text

from outbox.messages.backlog import retry_messages
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from relay.claims import Claimed, Failed, OutboxRow, record
from tests.integration.relay_support import ONE_LANE, Reader, put


def test_a_bulk_transaction_running_at_the_cursor_does_not_slow_a_lane_to_a_row_per_claim(
    engine: Engine,
) -> None:
    reader = Reader(engine, limit=10)
    with engine.connect() as bulk:
        bulk.begin()
        put(bulk, "bulk", 0)  # running when the cursor is taken: its rows are part a
        with engine.begin() as conn:  # a later id completes: the bulk one is in the xip list
            put(conn, "first", 0)
        assert len(reader.step()) == 1
        with engine.begin() as conn:
            for i in range(30):  # after the cursor: the id range, part b, lower ids
                put(conn, f"k{i}", i)
        for i in range(1, 51):  # ids above the range
            put(bulk, "bulk", i)
        bulk.commit()
    rows = reader.drain()
    assert len(rows) == 81
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    # 81 rows, 10 a claim: 9 claims (and the empty one that ends the drain), not one a row.
    assert reader.claims <= 1 + 9 + 1, reader.claims


def refuse(engine: Engine, ids: list[int], state: str, *, blocking: bool = False) -> None:
    """Copy outbox rows to outbox_failures as the relay records them."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.outbox_failures (id, message_id, topic, key, lane,"
            " message_type, payload, headers, run_id, created_at, state, blocking, error)"
            " SELECT id, message_id, topic, key, lane, message_type, payload, headers, run_id,"
            " created_at, :state, :blocking, 'refused' FROM outboxkit.outbox_messages"
            " WHERE id = ANY(:ids)"), {"ids": ids, "state": state, "blocking": blocking})


def blocked_key_b(engine: Engine, reader: Reader) -> tuple[int, int]:
    """Key a: refused, 25 rows held behind it; key b refused after them. Returns the id of
    b's refused row and a bound below b's next row, emitted after the refusals, unclaimed."""
    with engine.begin() as conn:
        for i in range(26):
            put(conn, "a", i)
        put(conn, "b", 0)
    rows = reader.drain()
    a_ids = [r.id for r in rows if r.key == b"a"]
    b_first = next(r.id for r in rows if r.key == b"b")
    refuse(engine, a_ids[:1], "failed", blocking=True)
    refuse(engine, a_ids[1:], "held")
    refuse(engine, [b_first], "failed", blocking=True)
    with engine.begin() as conn:
        put(conn, "b", 1)
    return b_first, b_first + 1


def test_a_key_blocked_behind_many_held_rows_of_another_key_stays_blocked(
    engine: Engine,
) -> None:
    reader = Reader(engine, limit=2)  # the claim used to read 10 x limit failure rows
    _, b_next = blocked_key_b(engine, reader)
    batch = reader.claim(2)
    [row] = [r for r in batch.rows if not r.retry]
    assert row.key == b"b"
    assert row.id >= b_next
    assert batch.blocked[row.lane_key] == "held"  # b's refusal still holds it back


def b_row(batch: Claimed) -> OutboxRow:
    """Key b's row emitted after its refusal (not a retried one)."""
    [row] = [r for r in batch.rows if r.key == b"b" and not r.retry]
    return row


def state_of(engine: Engine, row_id: int) -> str | None:
    with engine.connect() as conn:
        found = conn.execute(text("SELECT state FROM outboxkit.outbox_failures WHERE id = :i"),
                             {"i": row_id}).scalar()
    return None if found is None else str(found)


def set_aside(engine: Engine, reader: Reader, row: OutboxRow, *, token: int | None = None,
              retry_meanwhile: bool = False) -> None:
    """Record *row* as set aside by a batch of *reader*, as the daemon's record does."""
    owned = reader.lanes.owned()
    tokens = {lane: token if token is not None else t for lane, t in owned.items()}
    with reader.pool.begin() as conn:
        if retry_meanwhile:  # the operator's retry commits while the batch is in flight
            with engine.begin() as other:
                retry_messages(other)
        record(conn, "outboxkit", relay_id="reader", published=[], failed=[],
               set_aside=[row], cursors={}, blocking=True,
               incarnation=reader.incarnation, tokens=tokens)


def test_a_row_set_aside_while_an_operator_retries_its_key_follows_the_retry(
    engine: Engine,
) -> None:
    reader = Reader(engine, limit=100)
    b_first, _ = blocked_key_b(engine, reader)
    batch = reader.claim()
    row = b_row(batch)
    assert batch.blocked[row.lane_key] == "held"
    set_aside(engine, reader, row, retry_meanwhile=True)
    # Held with nothing before it, no retry would ever see it; it follows b's retried row.
    assert state_of(engine, b_first) == "retry"
    assert state_of(engine, row.id) == "retry"
    retried = reader.claim()
    b_rows = [r.id for r in retried.rows if r.retry and r.key == b"b"]
    assert b_rows == [b_first, row.id]


def test_a_row_set_aside_while_its_key_is_still_blocked_is_held(engine: Engine) -> None:
    reader = Reader(engine, limit=100)
    blocked_key_b(engine, reader)
    batch = reader.claim()
    row = b_row(batch)
    set_aside(engine, reader, row)
    assert state_of(engine, row.id) == "held"


def test_failure_copies_are_fenced_by_the_lanes_token(engine: Engine) -> None:
    reader = Reader(engine, limit=100)
    blocked_key_b(engine, reader)
    batch = reader.claim()
    row = b_row(batch)
    set_aside(engine, reader, row, token=-5)  # the lane was taken over meanwhile
    assert state_of(engine, row.id) is None


def test_a_keyless_row_refused_in_block_mode_holds_nothing_back(engine: Engine) -> None:
    """Keyless rows have no order to keep; a held keyless row could never be released
    (`outbox messages retry` matched held rows by key)."""
    reader = Reader(engine, limit=100)
    with engine.begin() as conn:
        emit(conn, Envelope(topic="t", type="t", key=None, payload={"i": 0}), settings=ONE_LANE)
    [refused] = reader.drain()
    with reader.pool.begin() as conn:
        record(conn, "outboxkit", relay_id="reader", published=[],
               failed=[Failed(refused, "InvalidRecord: refused", True)], set_aside=[],
               cursors={}, blocking=True, incarnation=reader.incarnation,
               tokens=reader.lanes.owned())
    with engine.begin() as conn:
        emit(conn, Envelope(topic="t", type="t", key=None, payload={"i": 1}), settings=ONE_LANE)
    assert state_of(engine, refused.id) == "failed"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT blocking FROM outboxkit.outbox_failures WHERE id = :i"),
                            {"i": refused.id}).scalar_one() is False
    batch = reader.claim()
    assert [r.key for r in batch.rows] == [None]
    assert batch.blocked == {}  # sent, not set aside


def test_a_record_waiting_for_an_operators_retry_holds_no_lane_row(engine: Engine) -> None:
    """The record of refused or set-aside rows takes the failures lock before it locks any
    lane row: while an operator's retry is still open (retry_messages never commits), the
    lane heartbeat renews the leases instead of waiting behind the record."""
    reader = Reader(engine, limit=100)
    blocked_key_b(engine, reader)
    batch = reader.claim()
    row = b_row(batch)
    [(lane, read)] = batch.reads.items()
    done = threading.Event()
    with engine.connect() as operator:
        operator.begin()
        retry_messages(operator)  # holds the failures lock until it commits

        def record_batch() -> None:
            with reader.pool.begin() as conn:
                conn.execute("SET LOCAL lock_timeout = '20s'")
                record(conn, "outboxkit", relay_id="reader", published=[], failed=[],
                       set_aside=[row], cursors={lane: (read.advanced(row.id), 0)},
                       blocking=True, incarnation=batch.incarnation, tokens=batch.tokens)
            done.set()

        recording = threading.Thread(target=record_batch)
        recording.start()
        time.sleep(0.5)
        assert not done.is_set()  # waiting for the operator
        with engine.begin() as conn:  # what the heartbeat's renew_lanes locks
            conn.execute(text("SET LOCAL lock_timeout = '2s'"))
            renewed = conn.execute(text(
                "SELECT lane FROM outboxkit.relay_lanes WHERE owner = 'reader' FOR UPDATE"
            )).scalars().all()
        assert renewed == [lane]
        operator.commit()
    recording.join(timeout=20)
    assert done.is_set()
    assert state_of(engine, row.id) == "retry"  # the retry came first: it follows it


def test_a_refused_rows_copy_keeps_its_run_though_the_claim_does_not_read_it(
    engine: Engine,
) -> None:
    reader = Reader(engine)
    with engine.begin() as conn:
        put(conn, "k", 1)
        run = conn.execute(text("UPDATE outboxkit.outbox_messages SET run_id = gen_random_uuid()"
                                " RETURNING run_id")).scalar_one()
    batch = reader.claim()
    [row] = batch.rows
    assert row.run_id is None  # not read: no record needs it
    with reader.pool.begin() as conn:
        record(conn, "outboxkit", relay_id=reader.relay_id, published=[],
               failed=[Failed(row, "refused for good", permanent=True)], set_aside=[],
               cursors={}, blocking=False, incarnation=batch.incarnation, tokens=batch.tokens)
    with engine.connect() as conn:
        copied = conn.execute(text("SELECT run_id FROM outboxkit.outbox_failures"
                                   " WHERE id = :id"), {"id": row.id}).scalar_one()
    assert copied == run
