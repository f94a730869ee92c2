"""Retention: whole id ranges of rows the lanes' cursors passed and old enough, one relay at a
time; a row not passed yet stays whatever its age."""

from __future__ import annotations

from sqlalchemy import Engine, text

from relay.retention import RETENTION_LOCK, purge_published
from tests.integration.relay_support import pool_of


def insert(engine: Engine, hours: str, count: int = 50, lane: int = 0) -> None:
    """*count* rows in one transaction, created *hours* ago (an SQL expression of h, which
    counts down to 1: the older rows first, as ids follow time)."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.outbox_messages (message_id, topic, key, lane, message_type,"
            " payload, created_at) SELECT gen_random_uuid(), 't', 'k', :lane, 't', '\\x00',"
            f" now() - make_interval(hours => {hours}) FROM generate_series(:n, 1, -1) h"),
            {"n": count, "lane": lane})


def set_cursor(engine: Engine, lane: int = 0) -> None:
    """The lane's cursor sees every transaction committed so far: their rows are passed."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.relay_lanes (lane) VALUES (:lane) ON CONFLICT DO NOTHING"),
            {"lane": lane})
        conn.execute(text(
            "UPDATE outboxkit.relay_lanes SET cursor_snapshot = pg_current_snapshot() "
            "WHERE lane = :lane"), {"lane": lane})


def ages(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT round(extract(epoch FROM now() - created_at) / 3600)::int "
            "FROM outboxkit.outbox_messages "
            "ORDER BY id")).scalars())


def test_deletes_passed_rows_older_than_the_retention_and_keeps_what_is_not_passed(
    engine: Engine,
) -> None:
    insert(engine, "h")  # 1..50 hours old
    set_cursor(engine)
    insert(engine, "100")  # older still, but committed after the cursor: not published yet
    deleted = purge_published(pool_of(engine), "outboxkit", older_than_s=10.5 * 3600, batch=7)
    assert deleted == 40  # the passed rows 11..50 hours old
    assert ages(engine) == list(range(10, 0, -1)) + [100] * 50


def test_rows_a_lane_behind_has_not_passed_stay(engine: Engine) -> None:
    insert(engine, "20", lane=0)
    insert(engine, "20", lane=1)
    set_cursor(engine, lane=0)  # lane 1 keeps the initial cursor, which passed nothing
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO outboxkit.relay_lanes (lane) VALUES (1) "
                          "ON CONFLICT DO NOTHING"))
    assert purge_published(pool_of(engine), "outboxkit", older_than_s=3600, batch=10) == 50
    with engine.connect() as conn:
        assert conn.execute(text(
            "SELECT lane, count(*) FROM outboxkit.outbox_messages GROUP BY 1")).all() == [(1, 50)]


def test_a_gap_in_the_ids_wider_than_a_range_does_not_stop_retention(engine: Engine) -> None:
    insert(engine, "30", count=5)
    with engine.begin() as conn:  # ids drawn by transactions that rolled back
        conn.execute(text(
            "SELECT setval('outboxkit.outbox_messages_id_seq', "
            "(SELECT max(id) FROM outboxkit.outbox_messages) + 1000)"))
    insert(engine, "30", count=5)
    set_cursor(engine)
    assert purge_published(pool_of(engine), "outboxkit", older_than_s=3600, batch=10) == 10


def test_a_second_relay_does_nothing_while_one_holds_the_retention_lock(engine: Engine) -> None:
    insert(engine, "h")
    set_cursor(engine)
    with engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": RETENTION_LOCK})
        assert purge_published(pool_of(engine), "outboxkit", older_than_s=0, batch=100) == 0
        holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": RETENTION_LOCK})
    assert purge_published(pool_of(engine), "outboxkit", older_than_s=0, batch=100) == 50


def test_old_deliveries_go_with_the_rows(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.deliveries (lane, relay_id, token, first_id, last_id, ids,"
            " partitions, offsets, published_at) VALUES"
            " (0, 'r', 1, 1, 2, '{1,2}', '{0,0}', '{5,6}', now() - interval '2 hours'),"
            " (0, 'r', 1, 3, 3, '{3}', '{0}', '{7}', now())"))
    insert(engine, "3", count=1)
    set_cursor(engine)
    purge_published(pool_of(engine), "outboxkit", older_than_s=3600, batch=10)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT ids FROM outboxkit.deliveries")).scalars().all() == [[3]]
