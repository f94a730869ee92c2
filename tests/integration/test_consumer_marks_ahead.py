"""The next batch's marks with the last batch's commit (Processor.offer), on real PostgreSQL:
an offer made while marks ahead are withdrawn stands, and a connection broken inside the
pipelined commit leaves nothing half-written (records built by hand, no Kafka)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from consumers import HandlerContext
from consumers.decode import decode_many
from consumers.metrics import ConsumerMetrics
from consumers.processing import Processor
from dedup.inbox import Mark, commit_then_insert_new, mark
from outbox.db.schema import translate
from outbox.settings import OutboxSettings
from tests.integration.test_dedup_processing import (
    TOPIC,
    FakeSender,
    Item,
    app_for,
    count,
    record,
    write,
)

SETTINGS = OutboxSettings()

IDLE_IN_TRANSACTION = ("SELECT count(*) FROM pg_stat_activity WHERE state = "
                       "'idle in transaction' AND datname = current_database()")


@pytest.fixture
def bound(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.effects (n integer NOT NULL)"))
    return engine.execution_options(schema_translate_map=translate(SETTINGS))


def kept(app: Any, engine: Engine, **kwargs: Any) -> Processor:
    return Processor(app, engine, ConsumerMetrics(), FakeSender(), keep_connection=True,
                     **kwargs)


def marked(engine: Engine) -> int:
    return count(engine, "SELECT count(*) FROM outboxkit.consumer_inbox")


def effects(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())


def terminate(engine: Engine, pid: int) -> None:
    """End backend *pid* from another connection, and wait until it is gone."""
    with engine.connect() as other:
        assert other.execute(text("SELECT pg_terminate_backend(:pid, 5000)"),
                             {"pid": pid}).scalar_one()


class TestAnOfferMadeMeanwhileStands:
    """withdraw() rolls back the marks inserted ahead and nothing else: the loop's offer of
    the batch behind, made before the withdraw ran on the handler thread, is still taken by
    the next commit (review finding L4: withdraw cleared it)."""

    def test_process_withdrawing_the_marks_ahead_keeps_the_offer_of_the_batch_behind(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch")
        app.register(TOPIC, write)
        processor = kept(app, bound)
        first = [record(0, {"n": 0})]
        second = [record(i, {"n": i}) for i in range(1, 4)]
        third = [record(i, {"n": i}) for i in range(4, 6)]
        processor.offer(second, decode_many(second, app.registrations))
        try:
            assert processor.process(first).handled == 1  # second's marks went in ahead
            processor.offer(None)  # the loop collected the first batch
            # Part of the second is handed over (the parking lot kept the rest), and the loop
            # offers the third behind it; process() withdraws the second's marks first.
            decoded = decode_many(third, app.registrations)
            processor.offer(third, decoded)
            assert processor.process(second[1:]).handled == 2
            assert count(bound, IDLE_IN_TRANSACTION) == 1  # the third's marks, ahead
            assert processor.process(third, decoded=decoded).handled == 2
        finally:
            processor.release()
        assert marked(bound) == 5
        assert effects(bound) == [0, 2, 3, 4, 5]

    def test_a_withdraw_running_after_the_next_offer_leaves_that_offer(
        self, bound: Engine, database_url: str
    ) -> None:
        """The loop dropped the second batch and submitted the withdraw, then handed over
        another and offered the one behind it before the handler thread got to the withdraw."""
        app = app_for(database_url, "batch")
        app.register(TOPIC, write)
        processor = kept(app, bound)
        first = [record(0, {"n": 0})]
        dropped = [record(1, {"n": 1})]
        other = [record(2, {"n": 2})]
        behind = [record(3, {"n": 3})]
        processor.offer(dropped, decode_many(dropped, app.registrations))
        try:
            assert processor.process(first).handled == 1
            processor.offer(None)
            decoded = decode_many(behind, app.registrations)
            processor.offer(behind, decoded)
            processor.withdraw()
            assert processor.process(other).handled == 1
            assert count(bound, IDLE_IN_TRANSACTION) == 1  # the marks of the one behind
            assert processor.process(behind, decoded=decoded).handled == 1
        finally:
            processor.release()
        assert marked(bound) == 3
        assert effects(bound) == [0, 2, 3]


def test_an_offer_is_taken_by_the_commit_of_the_batch_it_follows(
    bound: Engine, database_url: str
) -> None:
    """The loop offers a batch two behind the one being handled (the one between is queued):
    that commit leaves it, and the commit of the batch it follows takes it."""
    app = app_for(database_url, "batch")
    app.register(TOPIC, write)
    processor = kept(app, bound)
    first = [record(0, {"n": 0})]
    second = [record(1, {"n": 1})]
    third = [record(i, {"n": i}) for i in range(2, 4)]
    decoded = decode_many(third, app.registrations)
    processor.offer(third, decoded, after=second)
    try:
        assert processor.process(first, key=first).handled == 1
        assert count(bound, IDLE_IN_TRANSACTION) == 0  # not taken by the first's commit
        assert processor.process(second, key=second).handled == 1
        assert count(bound, IDLE_IN_TRANSACTION) == 1  # the third's marks, ahead
        assert processor.process(third, decoded=decoded, key=third).handled == 2
    finally:
        processor.release()
    assert marked(bound) == 4
    assert effects(bound) == [0, 1, 2, 3]


class TestBrokenInsideThePipeline:
    """The backend is terminated after a batch's statements, before its commit with the next
    batch's marks (COMMIT; BEGIN; INSERT in one round trip)."""

    def test_the_commit_raises_operational_error_with_the_connection_invalidated(
        self, engine: Engine
    ) -> None:
        with engine.connect() as conn:
            tx = conn.begin()
            mark(conn, "g", Mark("mine", "t", 0, 0), settings=SETTINGS)
            terminate(engine, conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            with pytest.raises(OperationalError) as raised:
                commit_then_insert_new(conn, "g", [Mark("next", "t", 0, 1)], settings=SETTINGS)
            assert raised.value.connection_invalidated
            assert conn.invalidated
            tx.rollback()
        assert marked(engine) == 0  # neither the batch's mark nor the next one's

    def test_the_batch_is_handled_again_and_the_next_one_finds_no_marks(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch")
        killed: list[int] = []

        def write_then_die(ctx: HandlerContext, item: Item) -> None:
            write(ctx, item)
            if item.n == 2 and not killed:  # the batch's last message, its first attempt
                killed.append(ctx.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
                terminate(bound, killed[0])

        app.register(TOPIC, write_then_die)
        committed: list[Any] = []
        processor = kept(app, bound, committed=committed.extend)
        first = [record(i, {"n": i}) for i in range(3)]
        second = [record(i, {"n": i}) for i in range(3, 6)]
        decoded = decode_many(second, app.registrations)
        processor.offer(second, decoded)
        try:
            # The commit failed: the batch is handled again on another connection.
            progress = processor.process(first)
            assert (progress.handled, progress.parked) == (3, ())
            assert killed
            assert effects(bound) == [0, 1, 2]
            assert marked(bound) == 3
            assert count(bound, IDLE_IN_TRANSACTION) == 0  # no marks of the next batch
            assert processor.process(second, decoded=decoded).handled == 3
        finally:
            processor.release()
        assert committed == first + second
        assert effects(bound) == [0, 1, 2, 3, 4, 5]
        assert marked(bound) == 6
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_failures") == 0

    def test_a_connection_lost_while_holding_the_marks_ahead_is_no_handler_failure(
        self, bound: Engine, database_url: str
    ) -> None:
        """Terminated between batches, idle in the transaction holding the next batch's
        marks: its handler's first statement meets the broken connection. The batch is
        handled again on another connection, with no attempt counted and nothing parked, as
        when the marks' own insert meets a broken connection."""
        app = app_for(database_url, "batch")
        app.register(TOPIC, write)
        processor = kept(app, bound)
        first = [record(0, {"n": 0})]
        second = [record(i, {"n": i}) for i in range(1, 4)]
        decoded = decode_many(second, app.registrations)
        processor.offer(second, decoded)
        try:
            assert processor.process(first).handled == 1
            with bound.connect() as conn:
                holding = conn.execute(text(IDLE_IN_TRANSACTION.replace("count(*)", "pid")))
                terminate(bound, holding.scalar_one())
            progress = processor.process(second, decoded=decoded)
        finally:
            processor.release()
        assert (progress.handled, progress.parked) == (3, ())
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_failures") == 0
        assert marked(bound) == 4
        assert effects(bound) == [0, 1, 2, 3]


@pytest.mark.parametrize("keep", [True, False])
def test_a_connection_lost_under_a_handler_counts_no_attempt(
    bound: Engine, database_url: str, keep: bool
) -> None:
    """The server ends the batch's backend while a handler runs (a restart, a failover):
    that handler's next statement fails, but the message is not to blame. The batch is
    handled again on another connection, with no attempt counted and nothing parked."""
    app = app_for(database_url, "batch")
    killed: list[int] = []

    def die_then_write(ctx: HandlerContext, item: Item) -> None:
        if item.n == 1 and not killed:
            killed.append(ctx.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            terminate(bound, killed[0])
        write(ctx, item)

    app.register(TOPIC, die_then_write)
    processor = Processor(app, bound, ConsumerMetrics(), FakeSender(), keep_connection=keep)
    try:
        progress = processor.process([record(i, {"n": i}) for i in range(3)])
    finally:
        processor.release()
    assert killed
    assert (progress.handled, progress.parked) == (3, ())
    assert count(bound, "SELECT count(*) FROM outboxkit.consumer_failures") == 0
    assert effects(bound) == [0, 1, 2]
    assert marked(bound) == 3

def test_a_batch_meeting_marks_ahead_not_its_own_is_marked_as_usual(
    bound: Engine, database_url: str
) -> None:
    """process() withdraws marks ahead that are not the batch's before handling it; the
    batch's plain transaction, reached with them still there, rolls them back and marks the
    batch itself (it took their presence for its own marks)."""
    app = app_for(database_url, "batch")
    app.register(TOPIC, write)
    processor = kept(app, bound)
    first = [record(0, {"n": 0})]
    second = [record(i, {"n": i}) for i in range(1, 4)]
    processor.offer(second, decode_many(second, app.registrations))
    try:
        assert processor.process(first).handled == 1
        processor.offer(None)
        assert processor._batch(second[1:]) == (2, None)  # not through process()
        assert processor.process(second[1:]).handled == 2  # delivered again: duplicates
    finally:
        processor.release()
    assert marked(bound) == 3
    assert effects(bound) == [0, 2, 3]
