"""A handler's writes in batch mode, on real PostgreSQL: as executed, or deferred on request.

``ctx.conn.execute`` is what it says: each statement reaches PostgreSQL when executed and
answers then (rows, row counts, errors). ``ctx.defer_insert`` is the fast way the handler
chooses: its rows are written together before the commit, and an error in one is still
charged to its own message, with nothing of the failed attempt committed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, text

from consumers import HandlerContext, SkipMessage
from consumers.deferred import DeferredInserts
from consumers.failures import list_failures
from consumers.metrics import ConsumerMetrics
from consumers.processing import Processor
from outbox.db.schema import translate
from outbox.settings import OutboxSettings
from tests.integration.test_dedup_processing import (
    TOPIC,
    FakeSender,
    Item,
    app_for,
    count,
    record,
)
from tests.integration.test_deferred_rows import sent_statements

effects = Table("effects", MetaData(schema="public"), Column("n", Integer, nullable=False))


def execute(ctx: HandlerContext, item: Item) -> None:
    ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})


def defer(ctx: HandlerContext, item: Item) -> None:
    ctx.defer_insert(effects, {"n": item.n})


WRITES = pytest.mark.parametrize("write", [execute, defer], ids=["executed", "deferred"])


@pytest.fixture
def bound(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.effects (n integer NOT NULL)"))
    return engine.execution_options(schema_translate_map=translate(OutboxSettings()))


@pytest.fixture
def inserts(engine: Engine) -> Iterator[list[str]]:
    """Every INSERT INTO public.effects statement sent to PostgreSQL, as sent."""
    with sent_statements(engine, "INSERT INTO PUBLIC.EFFECTS") as sent:
        yield sent


def run(
    bound: Engine, database_url: str, handler: Any, records: list[Any], *, mode: str = "batch",
    batch: bool = False,
) -> Processor:
    app = app_for(database_url, mode, max_attempts=5)
    if batch:
        app.register_batch(TOPIC, handler)
    else:
        app.register(TOPIC, handler)
    processor = Processor(app, bound, ConsumerMetrics(), FakeSender())
    processor.process(records)
    return processor


def rows(bound: Engine) -> list[int]:
    with bound.connect() as conn:
        return list(conn.execute(text("SELECT n FROM public.effects ORDER BY ctid")).scalars())


def the_failure(bound: Engine, processor: Processor) -> Any:
    with bound.connect() as conn:
        (failure,) = list_failures(conn, group=processor.group, status=None)
    return failure


class TestExecuted:
    """``ctx.conn.execute`` in batch mode: each statement answers when executed."""

    def test_an_insert_answers_its_row_count_at_once(
        self, bound: Engine, database_url: str, inserts: list[str]
    ) -> None:
        seen: list[int] = []

        def write(ctx: HandlerContext, item: Item) -> None:
            result = ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"),
                                      {"n": item.n})
            seen.append(result.rowcount)

        run(bound, database_url, write, [record(i, {"n": i}) for i in range(20)])
        assert seen == [1] * 20  # no statement is held back or rewritten
        assert len(inserts) == 20
        assert rows(bound) == list(range(20))
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 20

    def test_reads_see_the_inserts_before_them_and_updates_count_rows(
        self, bound: Engine, database_url: str
    ) -> None:
        seen: list[tuple[int, int, int]] = []

        def write_then_read(ctx: HandlerContext, item: Item) -> None:
            ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})
            # Straight through psycopg too: still after the INSERT above.
            raw = ctx.conn.connection.driver_connection
            assert raw is not None
            raw.execute("INSERT INTO public.effects (n) VALUES (%s)", (item.n + 1000,))
            total = ctx.conn.execute(text("SELECT count(*) FROM public.effects")).scalar_one()
            updated = ctx.conn.execute(
                text("UPDATE public.effects SET n = n WHERE n IN (:n, :m)"),
                {"n": item.n, "m": item.n + 1000},
            ).rowcount
            deleted = ctx.conn.execute(
                text("DELETE FROM public.effects WHERE n = :m"), {"m": item.n + 1000}
            ).rowcount
            seen.append((total, updated, deleted))

        run(bound, database_url, write_then_read, [record(i, {"n": i}) for i in range(10)])
        # Message i sees its two rows and the i rows the messages before it left.
        assert seen == [(i + 2, 2, 1) for i in range(10)]
        assert count(bound, "SELECT count(*) FROM public.effects") == 10

    def test_many_rows_at_once_and_statements_without_parameters_keep_their_order(
        self, bound: Engine, database_url: str
    ) -> None:
        def write(ctx: HandlerContext, item: Item) -> None:
            insert = text("INSERT INTO public.effects (n) VALUES (:n)")
            ctx.conn.execute(insert, [{"n": item.n * 10 + 1}, {"n": item.n * 10 + 2}])
            ctx.conn.exec_driver_sql(
                f"INSERT INTO public.effects (n) VALUES ({item.n * 10 + 3})")
            ctx.conn.execute(insert, {"n": item.n * 10 + 4})

        run(bound, database_url, write, [record(i, {"n": i}) for i in range(5)])
        assert rows(bound) == [i * 10 + j for i in range(5) for j in (1, 2, 3, 4)]


class TestDeferred:
    """``ctx.defer_insert``: the batch's rows in one statement, before the commit."""

    def test_a_batch_s_deferred_rows_go_in_one_statement_and_commit_with_the_marks(
        self, bound: Engine, database_url: str, inserts: list[str]
    ) -> None:
        run(bound, database_url, defer, [record(i, {"n": i}) for i in range(20)])
        assert len(inserts) == 1, inserts
        assert rows(bound) == list(range(20))  # in the order deferred
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 20

    def test_a_later_statement_of_the_batch_does_not_see_deferred_rows(
        self, bound: Engine, database_url: str
    ) -> None:
        seen: list[int] = []

        def write_then_read(ctx: HandlerContext, item: Item) -> None:
            ctx.defer_insert(effects, {"n": item.n})
            seen.append(ctx.conn.execute(text("SELECT count(*) FROM public.effects"))
                        .scalar_one())

        run(bound, database_url, write_then_read, [record(i, {"n": i}) for i in range(5)])
        assert seen == [0] * 5  # the trade-off the docs state
        assert count(bound, "SELECT count(*) FROM public.effects") == 5

    def test_tables_are_written_in_the_order_first_deferred(
        self, bound: Engine, database_url: str, inserts: list[str]
    ) -> None:
        with bound.begin() as conn:
            conn.execute(text("CREATE UNIQUE INDEX ON public.effects (n)"))
            conn.execute(text("CREATE TABLE public.effect_lines (n integer NOT NULL "
                              "REFERENCES public.effects (n))"))
        lines = Table("effect_lines", MetaData(schema="public"), Column("n", Integer))

        def write(ctx: HandlerContext, item: Item) -> None:
            ctx.defer_insert(effects, {"n": item.n})
            ctx.defer_insert(lines, {"n": item.n})  # needs the row above: written after it

        run(bound, database_url, write, [record(i, {"n": i}) for i in range(6)])
        assert count(bound, "SELECT count(*) FROM public.effect_lines") == 6
        assert len(inserts) == 1  # effects' six rows in one statement

    @pytest.mark.parametrize("batch", [False, True], ids=["per-message", "batch-handler"])
    @pytest.mark.parametrize(
        ("ns", "bad"),
        [
            ([0, 1, 2, 1, 4, 5], 3),  # offset 3 repeats offset 1's n
            ([*range(180), 7, *range(1000, 1100)], 180),
        ],
        ids=["small", "large"],
    )
    def test_an_error_in_a_deferred_row_is_charged_to_its_message_and_nothing_half_commits(
        self, bound: Engine, database_url: str, ns: list[int], bad: int, batch: bool
    ) -> None:
        with bound.begin() as conn:
            conn.execute(text("CREATE UNIQUE INDEX ON public.effects (n)"))
        called: list[int] = []

        def write(ctx: HandlerContext, item: Item) -> None:
            called.append(ctx.offset)
            ctx.defer_insert(effects, {"n": item.n})

        def write_batch(items: Sequence[tuple[HandlerContext, Item]]) -> None:
            for ctx, item in items:
                write(ctx, item)

        handler: Callable[..., None] = write_batch if batch else write
        records = [record(i, {"n": n}) for i, n in enumerate(ns)]
        processor = run(bound, database_url, handler, records, batch=batch)
        # The call succeeded; the row failed when written, in the batch, and again alone.
        assert bad in called
        # What came before it committed, nothing of it or after it in its partition did.
        assert rows(bound) == ns[:bad]
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == bad
        failure = the_failure(bound, processor)
        assert (failure.offset, failure.attempts) == (bad, 1)
        assert "unique" in (failure.last_error or "").lower()

    def test_a_handler_error_after_deferred_rows_commits_the_messages_before_it(
        self, bound: Engine, database_url: str
    ) -> None:
        def write(ctx: HandlerContext, item: Item) -> None:
            ctx.defer_insert(effects, {"n": item.n})
            if item.fail:
                raise RuntimeError("boom")

        records = [record(i, {"n": i, "fail": i == 4}) for i in range(8)]
        processor = run(bound, database_url, write, records)
        assert rows(bound) == [0, 1, 2, 3]
        assert the_failure(bound, processor).offset == 4

    def test_a_skipped_message_s_deferred_rows_are_dropped(
        self, bound: Engine, database_url: str
    ) -> None:
        def write(ctx: HandlerContext, item: Item) -> None:
            ctx.defer_insert(effects, {"n": item.n})
            if item.fail:
                raise SkipMessage("not ours")

        records = [record(i, {"n": i, "fail": i == 2}) for i in range(5)]
        run(bound, database_url, write, records)
        assert rows(bound) == [0, 1, 3, 4]
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 5

    def test_per_message_mode_inserts_at_the_call(
        self, bound: Engine, database_url: str
    ) -> None:
        with bound.begin() as conn:
            conn.execute(text("CREATE UNIQUE INDEX ON public.effects (n)"))
        seen: list[int] = []

        def write_then_read(ctx: HandlerContext, item: Item) -> None:
            ctx.defer_insert(effects, {"n": item.n})
            seen.append(ctx.conn.execute(text("SELECT count(*) FROM public.effects"))
                        .scalar_one())

        records = [record(i, {"n": n}) for i, n in enumerate([0, 1, 1, 3])]
        processor = run(bound, database_url, write_then_read, records, mode="per-message")
        assert seen == [1, 2]  # its own row seen at once; the third raised at its call
        assert rows(bound) == [0, 1]
        assert the_failure(bound, processor).offset == 2

    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_a_misspelt_column_fails_its_message_instead_of_dropping_the_value(
        self, bound: Engine, database_url: str, mode: str
    ) -> None:
        def misspelt(ctx: HandlerContext, item: Item) -> None:
            ctx.defer_insert(effects, {"n": item.n} if item.n != 2 else {"n": 2, "m": 0})

        records = [record(i, {"n": i}) for i in range(4)]
        processor = run(bound, database_url, misspelt, records, mode=mode)
        assert rows(bound) == [0, 1]  # its partition waits behind the failed message
        failure = the_failure(bound, processor)
        assert failure.offset == 2
        assert "has no column 'm'" in failure.last_error

    def test_an_error_writing_deferred_rows_names_the_table(self, bound: Engine) -> None:
        with bound.begin() as conn:
            conn.execute(text("CREATE UNIQUE INDEX ON public.effects (n)"))
        deferred = DeferredInserts()
        deferred.add(effects, {"n": 1})
        deferred.add(effects, {"n": 1})
        with bound.connect() as conn, pytest.raises(Exception, match="unique") as raised:
            deferred.write(conn)
        assert raised.value.__notes__ == [
            "raised writing 2 row(s) deferred with ctx.defer_insert into 'effects'"]


@WRITES
def test_both_ways_commit_the_same_rows(
    bound: Engine, database_url: str, write: Callable[[HandlerContext, Item], None]
) -> None:
    run(bound, database_url, write, [record(i, {"n": i}) for i in range(30)])
    assert rows(bound) == list(range(30))
    assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 30
