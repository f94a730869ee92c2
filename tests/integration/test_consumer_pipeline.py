"""A batch's plain INSERTs kept and sent together (consumers.pipeline), on real PostgreSQL.

What the handler sees must stay what it saw statement by statement: its rows, UPDATE row
counts, the order of its writes; an INSERT that fails later than it was executed must still
be charged to its own message.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, text

from consumers import HandlerContext
from consumers.metrics import ConsumerMetrics
from consumers.pipeline import deferrable
from consumers.processing import Processor
from dedup.failures import list_failures
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


@pytest.mark.parametrize(
    ("statement", "kept"),
    [
        ("INSERT INTO t (a) VALUES (%(a)s)", True),
        ("  \n-- a comment\n/* another */ insert into t values (1)", True),
        ("INSERT INTO t (a) VALUES (%(a)s) RETURNING id", False),
        ("INSERT INTO t (a) VALUES (%(a)s) ON CONFLICT DO NOTHING", False),
        ("INSERT INTO t SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM t)", False),
        ("WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x", False),
        ("UPDATE t SET a = 1", False),
        ("DELETE FROM t", False),
        ("SELECT 1", False),
        ("SAVEPOINT sa_1", False),
        ("inserted", False),
    ],
)
def test_only_inserts_whose_answer_nobody_needs_are_kept(statement: str, kept: bool) -> None:
    assert deferrable(statement) is kept


@pytest.fixture
def bound(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.effects (n integer NOT NULL)"))
    return engine.execution_options(schema_translate_map=translate(OutboxSettings()))


def run(bound: Engine, database_url: str, handler: Any, records: list[Any]) -> Processor:
    app = app_for(database_url, "batch", max_attempts=5)
    app.register(TOPIC, handler)
    processor = Processor(app, bound, ConsumerMetrics(), FakeSender())
    processor.process(records)
    return processor


def test_a_batch_s_inserts_are_kept_and_commit_with_the_marks(
    bound: Engine, database_url: str
) -> None:
    seen: list[int] = []

    def write(ctx: HandlerContext, item: Item) -> None:
        result = ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"),
                                  {"n": item.n})
        seen.append(result.rowcount)

    run(bound, database_url, write, [record(i, {"n": i}) for i in range(20)])
    # -1: kept, not waited for (without the pipeline each INSERT answers 1).
    assert seen == [-1] * 20
    assert count(bound, "SELECT count(*) FROM public.effects") == 20
    assert count(bound, "SELECT count(DISTINCT n) FROM public.effects") == 20
    assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 20


def test_reads_see_the_kept_inserts_before_them_and_updates_count_rows(
    bound: Engine, database_url: str
) -> None:
    seen: list[tuple[int, int, int]] = []

    def write_then_read(ctx: HandlerContext, item: Item) -> None:
        ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})
        # Straight through psycopg too: still after the kept INSERT.
        raw = ctx.conn.connection.driver_connection
        assert raw is not None
        raw.execute("INSERT INTO public.effects (n) VALUES (%s)", (item.n + 1000,))
        rows = ctx.conn.execute(text("SELECT count(*) FROM public.effects")).scalar_one()
        updated = ctx.conn.execute(
            text("UPDATE public.effects SET n = n WHERE n IN (:n, :m)"),
            {"n": item.n, "m": item.n + 1000},
        ).rowcount
        deleted = ctx.conn.execute(
            text("DELETE FROM public.effects WHERE n = :m"), {"m": item.n + 1000}
        ).rowcount
        seen.append((rows, updated, deleted))

    run(bound, database_url, write_then_read, [record(i, {"n": i}) for i in range(10)])
    # Message i sees its two rows and the i rows the messages before it left.
    assert seen == [(i + 2, 2, 1) for i in range(10)]
    assert count(bound, "SELECT count(*) FROM public.effects") == 10


def test_many_rows_at_once_and_statements_without_parameters_are_kept_in_order(
    bound: Engine, database_url: str
) -> None:
    def write(ctx: HandlerContext, item: Item) -> None:
        insert = text("INSERT INTO public.effects (n) VALUES (:n)")
        ctx.conn.execute(insert, [{"n": item.n * 10 + 1}, {"n": item.n * 10 + 2}])
        ctx.conn.exec_driver_sql(f"INSERT INTO public.effects (n) VALUES ({item.n * 10 + 3})")
        ctx.conn.execute(insert, {"n": item.n * 10 + 4})

    run(bound, database_url, write, [record(i, {"n": i}) for i in range(5)])
    with bound.connect() as conn:
        rows = conn.execute(text("SELECT n FROM public.effects ORDER BY ctid")).scalars().all()
    assert rows == [i * 10 + j for i in range(5) for j in (1, 2, 3, 4)]


@pytest.mark.parametrize(
    ("ns", "bad"),
    [
        ([0, 1, 2, 1, 4, 5], 3),  # offset 3 repeats offset 1's n
        # Past SEND_EVERY: the failing INSERT was sent while the handlers went on.
        ([*range(180), 7, *range(1000, 1100)], 180),
    ],
    ids=["small", "sent-while-handling"],
)
def test_a_kept_insert_that_fails_later_is_charged_to_its_own_message(
    bound: Engine, database_url: str, ns: list[int], bad: int
) -> None:
    with bound.begin() as conn:
        conn.execute(text("CREATE UNIQUE INDEX ON public.effects (n)"))
    calls: list[int] = []

    def write(ctx: HandlerContext, item: Item) -> None:
        calls.append(ctx.offset)
        ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})

    # The repeated n's INSERT fails, seen only at a later statement or at the commit.
    processor = run(bound, database_url, write, [record(i, {"n": n}) for i, n in enumerate(ns)])
    # What came before it committed; nothing after it in its partition was handled.
    assert count(bound, "SELECT count(*) FROM public.effects") == bad
    assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == bad
    with bound.connect() as conn:
        (failure,) = list_failures(conn, group=processor.group, status=None)
    assert (failure.offset, failure.attempts) == (bad, 1)
    assert "unique" in (failure.last_error or "").lower()


def test_a_handler_error_after_kept_inserts_commits_the_messages_before_it(
    bound: Engine, database_url: str
) -> None:
    def write(ctx: HandlerContext, item: Item) -> None:
        ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})
        if item.fail:
            raise RuntimeError("boom")

    records = [record(i, {"n": i, "fail": i == 4}) for i in range(8)]
    processor = run(bound, database_url, write, records)
    assert count(bound, "SELECT count(*) FROM public.effects") == 4
    with bound.connect() as conn:
        (failure,) = list_failures(conn, group=processor.group, status=None)
    assert failure.offset == 4
