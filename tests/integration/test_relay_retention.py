"""Retention of published rows: batched, only old published rows, one relay at a time."""

from __future__ import annotations

from sqlalchemy import Engine, text

from relay.retention import RETENTION_LOCK, purge_published


def seed(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outboxkit.outbox_messages (message_id, topic, key, lane, message_type,"
            " payload, status, published_at) SELECT gen_random_uuid(), 't', 'k', 0, 't', '\\x00',"
            " s, CASE WHEN s = 'published' THEN now() - make_interval(hours => h) END"
            " FROM generate_series(1, 50) h, unnest(ARRAY['published', 'pending', 'failed']) s"))


def counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT status, count(*) FROM outboxkit.outbox_messages GROUP BY 1")).all())


def test_deletes_only_published_rows_older_than_the_retention_in_batches(engine: Engine) -> None:
    seed(engine)
    deleted = purge_published(engine, "outboxkit", older_than_s=10.5 * 3600, batch=7)
    assert deleted == 40  # published 11..50 hours ago
    assert counts(engine) == {"published": 10, "pending": 50, "failed": 50}


def test_a_second_relay_does_nothing_while_one_holds_the_retention_lock(engine: Engine) -> None:
    seed(engine)
    with engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": RETENTION_LOCK})
        assert purge_published(engine, "outboxkit", older_than_s=0, batch=100) == 0
        holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": RETENTION_LOCK})
    assert purge_published(engine, "outboxkit", older_than_s=0, batch=100) == 50
