"""The dedup (inbox) table: marks written with the caller's transaction, and their retention."""

from __future__ import annotations

import threading

from sqlalchemy import Engine, text

from dedup.inbox import Mark, is_marked, mark, mark_many, purge_marks, unmark

SCHEMA = "outboxkit"


def m(message_id: str, offset: int = 0) -> Mark:
    return Mark(message_id, "orders", 0, offset)


class TestMarks:
    def test_a_new_id_is_marked_once_and_a_second_delivery_is_a_duplicate(
        self, engine: Engine
    ) -> None:
        with engine.begin() as conn:
            assert mark(conn, SCHEMA, "g", m("a")) is True
        with engine.begin() as conn:
            assert mark(conn, SCHEMA, "g", m("a", 7)) is False
            assert is_marked(conn, SCHEMA, "g", "a")

    def test_mark_many_reports_only_new_ids_and_absorbs_repeats_within_the_batch(
        self, engine: Engine
    ) -> None:
        with engine.begin() as conn:
            mark(conn, SCHEMA, "g", m("old"))
        with engine.begin() as conn:
            new = mark_many(conn, SCHEMA, "g", [m("old"), m("x", 1), m("y", 2), m("x", 3)])
        assert new == {"x", "y"}

    def test_groups_are_independent(self, engine: Engine) -> None:
        with engine.begin() as conn:
            assert mark(conn, SCHEMA, "g1", m("a"))
            assert mark(conn, SCHEMA, "g2", m("a"))

    def test_a_rolled_back_transaction_leaves_no_mark(self, engine: Engine) -> None:
        with engine.connect() as conn:
            with conn.begin() as tx:
                mark(conn, SCHEMA, "g", m("a"))
                tx.rollback()
            assert not is_marked(conn, SCHEMA, "g", "a")

    def test_unmark_lets_the_message_be_processed_again(self, engine: Engine) -> None:
        with engine.begin() as conn:
            mark(conn, SCHEMA, "g", m("a"))
            unmark(conn, SCHEMA, "g", "a")
            assert mark(conn, SCHEMA, "g", m("a"))

    def test_two_concurrent_deliveries_of_one_message_mark_it_exactly_once(
        self, engine: Engine
    ) -> None:
        """The second transaction waits on the first's uncommitted mark, then sees it."""
        results: list[bool] = []
        barrier = threading.Barrier(4)

        def deliver() -> None:
            barrier.wait()
            with engine.begin() as conn:
                results.append(mark(conn, SCHEMA, "g", m("same")))

        threads = [threading.Thread(target=deliver) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, False, False, True]


class TestRetention:
    def test_purge_deletes_only_the_groups_marks_older_than_the_window(
        self, engine: Engine
    ) -> None:
        with engine.begin() as conn:
            mark_many(conn, SCHEMA, "g", [m(f"old-{i}", i) for i in range(25)])
            mark(conn, SCHEMA, "g", m("new"))
            mark(conn, SCHEMA, "other", m("old-0"))
            conn.execute(
                text(
                    "UPDATE outboxkit.consumer_inbox SET processed_at = now() - interval '2 hours'"
                    " WHERE message_id LIKE 'old-%'"
                )
            )
        deleted = purge_marks(engine, SCHEMA, "g", older_than_s=3600, batch=10)
        assert deleted == 25
        with engine.connect() as conn:
            left = conn.execute(
                text("SELECT consumer_group, message_id FROM outboxkit.consumer_inbox ORDER BY 1")
            ).all()
        assert [tuple(r) for r in left] == [("g", "new"), ("other", "old-0")]

    def test_only_one_process_purges_at_a_time(self, engine: Engine) -> None:
        with engine.begin() as conn:
            mark(conn, SCHEMA, "g", m("a"))
            conn.execute(
                text("UPDATE outboxkit.consumer_inbox SET processed_at = now() - interval '1 day'")
            )
        from outbox.hashing import stable_hash64  # noqa: PLC0415

        key = stable_hash64(b"outboxkit.dedup.retention", SCHEMA.encode(), b"g")
        with engine.connect() as holder, holder.begin():
            holder.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
            assert purge_marks(engine, SCHEMA, "g", older_than_s=60, batch=10) == 0
        assert purge_marks(engine, SCHEMA, "g", older_than_s=60, batch=10) == 1
