"""The dedup (inbox) table: marks written with the caller's transaction, and their retention."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from dedup.inbox import (
    Mark,
    Marks,
    commit_then_insert_new,
    insert_new,
    is_marked,
    mark,
    mark_many,
    purge_marks,
    unmark,
)
from outbox.settings import OutboxSettings

SETTINGS = OutboxSettings(schema_name="outboxkit")


def m(message_id: str, offset: int = 0) -> Mark:
    return Mark(message_id, "orders", 0, offset)


class TestMarks:
    def test_a_new_id_is_marked_once_and_a_second_delivery_is_a_duplicate(
        self, engine: Engine
    ) -> None:
        with engine.begin() as conn:
            assert mark(conn, "g", m("a"), settings=SETTINGS) is True
        with engine.begin() as conn:
            assert mark(conn, "g", m("a", 7), settings=SETTINGS) is False
            assert is_marked(conn, "g", "a", settings=SETTINGS)

    def test_mark_many_reports_only_new_ids_and_absorbs_repeats_within_the_batch(
        self, engine: Engine
    ) -> None:
        with engine.begin() as conn:
            mark(conn, "g", m("old"), settings=SETTINGS)
        with engine.begin() as conn:
            batch = [m("old"), m("x", 1), m("y", 2), m("x", 3)]
            new = mark_many(conn, "g", batch, settings=SETTINGS)
        assert new == {"x", "y"}

    def test_ids_with_array_syntax_are_stored_as_they_are(self, engine: Engine) -> None:
        """The marks go as array literals: quotes, backslashes, commas, braces, spaces and a
        NULL spelling are elements' text, not syntax."""
        odd = ['a"b', "c\\d", "e,f", "{g}", " h ", "NULL", "i\\\"j", "k\nl"]
        with engine.begin() as conn:
            assert mark_many(conn, "g", [m(x, n) for n, x in enumerate(odd)],
                             settings=SETTINGS) == set(odd)
            insert_new(conn, "g2", Marks.of([m(x, n) for n, x in enumerate(odd)]),
                       settings=SETTINGS)
            stored = conn.execute(text(
                "SELECT consumer_group, message_id, kafka_offset FROM outboxkit.consumer_inbox"
                " WHERE consumer_group IN ('g', 'g2')")).all()
        assert sorted(stored) == sorted(
            [("g", x, n) for n, x in enumerate(odd)] + [("g2", x, n) for n, x in enumerate(odd)])

    def test_groups_are_independent(self, engine: Engine) -> None:
        with engine.begin() as conn:
            assert mark(conn, "g1", m("a"), settings=SETTINGS)
            assert mark(conn, "g2", m("a"), settings=SETTINGS)

    def test_a_rolled_back_transaction_leaves_no_mark(self, engine: Engine) -> None:
        with engine.connect() as conn:
            with conn.begin() as tx:
                mark(conn, "g", m("a"), settings=SETTINGS)
                tx.rollback()
            assert not is_marked(conn, "g", "a", settings=SETTINGS)

    def test_unmark_lets_the_message_be_processed_again(self, engine: Engine) -> None:
        with engine.begin() as conn:
            mark(conn, "g", m("a"), settings=SETTINGS)
            unmark(conn, "g", "a", settings=SETTINGS)
            assert mark(conn, "g", m("a"), settings=SETTINGS)

    def test_two_concurrent_deliveries_of_one_message_mark_it_exactly_once(
        self, engine: Engine
    ) -> None:
        """The second transaction waits on the first's uncommitted mark, then sees it."""
        results: list[bool] = []
        barrier = threading.Barrier(4)

        def deliver() -> None:
            barrier.wait()
            with engine.begin() as conn:
                results.append(mark(conn, "g", m("same"), settings=SETTINGS))

        threads = [threading.Thread(target=deliver) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, False, False, True]


class TestCommitThenInsertNew:
    """The last transaction's commit and the next one's marks in one round trip."""

    @staticmethod
    def stored(engine: Engine, group: str) -> set[str]:
        with engine.connect() as conn:
            return set(conn.execute(text(
                "SELECT message_id FROM outboxkit.consumer_inbox WHERE consumer_group = :g"),
                {"g": group}).scalars())

    def test_commits_then_holds_the_next_marks_in_an_open_transaction(
        self, engine: Engine
    ) -> None:
        odd = ['a"b', "c\\d", "e,f", "{g}", " h ", "NULL", "it's", "k\nl"]
        with engine.connect() as conn:
            tx = conn.begin()
            mark(conn, "g", m("first"), settings=SETTINGS)
            assert commit_then_insert_new(
                conn, "g", [m(x, n) for n, x in enumerate(odd)], settings=SETTINGS) is True
            assert tx.is_active  # SQLAlchemy's transaction stands for the new one
            assert self.stored(engine, "g") == {"first"}  # committed; the next not yet
            assert is_marked(conn, "g", "it's", settings=SETTINGS)
            tx.commit()
        assert self.stored(engine, "g") == {"first", *odd}

    def test_a_mark_already_there_leaves_the_commit_done_and_the_next_aborted(
        self, engine: Engine
    ) -> None:
        with engine.begin() as conn:
            mark(conn, "g", m("seen"), settings=SETTINGS)
        with engine.connect() as conn:
            tx = conn.begin()
            mark(conn, "g", m("mine"), settings=SETTINGS)
            assert commit_then_insert_new(conn, "g", [m("new"), m("seen", 1)],
                                          settings=SETTINGS) is False
            tx.rollback()  # the aborted next transaction
            assert self.stored(engine, "g") == {"seen", "mine"}
            with conn.begin():  # the connection is usable again
                assert not is_marked(conn, "g", "new", settings=SETTINGS)

    def test_a_failed_commit_raises_and_inserts_nothing(self, engine: Engine) -> None:
        with engine.begin() as conn:
            conn.execute(text(
                "CREATE TABLE public.late (n integer, CONSTRAINT late_n UNIQUE (n) "
                "DEFERRABLE INITIALLY DEFERRED)"))
        with engine.connect() as conn:
            tx = conn.begin()
            mark(conn, "g", m("doomed"), settings=SETTINGS)
            conn.execute(text("INSERT INTO public.late VALUES (1), (1)"))  # checked at COMMIT
            with pytest.raises(IntegrityError):
                commit_then_insert_new(conn, "g", [m("next")], settings=SETTINGS)
            tx.rollback()
        assert self.stored(engine, "g") == set()

    def test_without_a_transaction_or_marks_nothing_is_sent(self, engine: Engine) -> None:
        with engine.connect() as conn:
            assert commit_then_insert_new(conn, "g", [m("x")], settings=SETTINGS) is None
            with conn.begin():
                mark(conn, "g", m("y"), settings=SETTINGS)
                assert commit_then_insert_new(conn, "g", [], settings=SETTINGS) is None
        assert self.stored(engine, "g") == {"y"}


class TestRetention:
    def test_purge_deletes_only_the_groups_marks_older_than_the_window(
        self, engine: Engine
    ) -> None:
        with engine.begin() as conn:
            mark_many(conn, "g", [m(f"old-{i}", i) for i in range(25)], settings=SETTINGS)
            mark(conn, "g", m("new"), settings=SETTINGS)
            mark(conn, "other", m("old-0"), settings=SETTINGS)
            conn.execute(
                text(
                    "UPDATE outboxkit.consumer_inbox SET processed_at = now() - interval '2 hours'"
                    " WHERE message_id LIKE 'old-%'"
                )
            )
        deleted = purge_marks(engine, "g", older_than_s=3600, batch=10, settings=SETTINGS)
        assert deleted == 25
        with engine.connect() as conn:
            left = conn.execute(
                text("SELECT consumer_group, message_id FROM outboxkit.consumer_inbox ORDER BY 1")
            ).all()
        assert [tuple(r) for r in left] == [("g", "new"), ("other", "old-0")]

    def test_only_one_process_purges_at_a_time(self, engine: Engine) -> None:
        with engine.begin() as conn:
            mark(conn, "g", m("a"), settings=SETTINGS)
            conn.execute(
                text("UPDATE outboxkit.consumer_inbox SET processed_at = now() - interval '1 day'")
            )
        from outbox.db.hashing import stable_hash64  # noqa: PLC0415

        key = stable_hash64(b"outboxkit.dedup.retention", SETTINGS.schema_name.encode(), b"g")
        with engine.connect() as holder, holder.begin():
            holder.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
            assert purge_marks(engine, "g", older_than_s=60, batch=10, settings=SETTINGS) == 0
        assert purge_marks(engine, "g", older_than_s=60, batch=10, settings=SETTINGS) == 1
