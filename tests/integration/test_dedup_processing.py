"""The consumer's processing core on real PostgreSQL (records built by hand, no Kafka)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, create_engine, text

from consumers import Consumer, HandlerContext, RetryLater, SkipMessage
from consumers.deadletter import Sent
from consumers.decode import decode_many
from consumers.failures import list_failures
from consumers.metrics import ConsumerMetrics
from consumers.processing import Processor, Progress
from dedup.ledger import Applied, Evidence, Ledger
from outbox.db.dsn import sqlalchemy_url
from outbox.db.schema import translate
from outbox.messages.envelope import Envelope
from outbox.settings import OutboxSettings
from tests.e2e.consumer_support import settings

LEDGER = Ledger()

TOPIC = "items"


class Item(BaseModel):
    n: int
    fail: bool = False


@dataclass
class Record:
    offset: int
    value: bytes
    headers: list[tuple[str, bytes]]
    topic: str = TOPIC
    partition: int = 0
    key: bytes | None = b"k"


def record(offset: int, payload: dict[str, Any], message_id: str | None = None) -> Record:
    mid = message_id or str(uuid.uuid4())
    return Record(offset, json.dumps(payload).encode(), [("message-id", mid.encode())])


@dataclass
class FakeSender:
    sent: list[tuple[str, bytes | None]] = field(default_factory=list)

    def __call__(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> Sent:
        self.sent.append((topic, value))
        return Sent(topic, 0, len(self.sent) - 1)


@pytest.fixture
def bound(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.effects (n integer NOT NULL)"))
    return engine.execution_options(schema_translate_map=translate(OutboxSettings()))


def count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def app_for(database_url: str, mode: str, **overrides: Any) -> Consumer:
    return Consumer(
        f"g-{uuid.uuid4().hex[:6]}",
        settings=settings(database_url, "127.0.0.1:1", mode=mode, **overrides),
    )


def drain(processor: Processor, records: Sequence[Record], deadline_s: float = 20) -> int:
    """Process *records* as the runner does: a parked message is fed again, as a retry with
    the rest of its partition behind it, once it is due. How many records were handled."""
    handled, batch, retries = 0, list(records), frozenset[tuple[str, int, int]]()
    give_up = time.monotonic() + deadline_s
    while batch:
        progress: Progress = processor.process(batch, retries)
        handled += progress.handled
        if not progress.parked:
            break
        assert time.monotonic() < give_up, f"still parked after {deadline_s} s: {progress}"
        time.sleep(max(0.0, max(p.due for p in progress.parked) - time.monotonic()))
        retries = frozenset((p.topic, p.partition, p.offset) for p in progress.parked)
        batch = [r for r in records if any(
            (r.topic, r.partition) == (p.topic, p.partition) and r.offset >= p.offset
            for p in progress.parked)]
    return handled


def write(ctx: HandlerContext, item: Item) -> None:
    ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})
    ctx.emit(Envelope(topic="follow-up", type="t", key="k", payload={"n": item.n}))
    if item.fail:
        raise RuntimeError("boom")


def write_each(batch: Sequence[tuple[HandlerContext, Item]]) -> None:
    for ctx, item in batch:
        write(ctx, item)


class TestTransactions:
    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_a_failed_handler_leaves_neither_mark_nor_follow_up_nor_effect(
        self, bound: Engine, database_url: str, mode: str
    ) -> None:
        app = app_for(database_url, mode, max_attempts=5)
        stop = threading.Event()

        def fail_then_stop(ctx: HandlerContext, item: Item) -> None:
            write(ctx, item)
            stop.set()  # the retry wait returns at once: we look at the state after attempt 1
            raise RuntimeError("boom")

        app.register(TOPIC, fail_then_stop)
        processor = Processor(app, bound, ConsumerMetrics(), FakeSender(), stop=stop)
        assert processor.process([record(0, {"n": 1})]).handled == 0
        assert count(bound, "SELECT count(*) FROM public.effects") == 0
        assert count(bound, "SELECT count(*) FROM outboxkit.outbox_messages") == 0
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 0
        assert count(bound, "SELECT attempts FROM outboxkit.consumer_failures") == 1

    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_a_handled_message_commits_effect_mark_and_follow_up_together(
        self, bound: Engine, database_url: str, mode: str
    ) -> None:
        app = app_for(database_url, mode)
        app.register(TOPIC, write)
        committed: list[Any] = []
        processor = Processor(
            app, bound, ConsumerMetrics(), FakeSender(), committed=committed.extend
        )
        records = [record(i, {"n": i}) for i in range(5)]
        assert processor.process(records).handled == 5
        assert committed == records
        assert count(bound, "SELECT count(*) FROM public.effects") == 5
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 5
        causes = count(
            bound,
            "SELECT count(DISTINCT headers->>'causation-id') FROM outboxkit.outbox_messages",
        )
        assert causes == 5

    @pytest.mark.parametrize("batch_handler", [False, True])
    def test_a_batch_with_marked_and_repeated_ids_has_each_effect_once(
        self, bound: Engine, database_url: str, batch_handler: bool
    ) -> None:
        """The plain insert of a batch's marks is refused by the ones already there (and an
        id twice in the batch): the careful insert then drops exactly the duplicates."""
        app = app_for(database_url, "batch")
        if batch_handler:
            app.register_batch(TOPIC, write_each)
        else:
            app.register(TOPIC, write)
        metrics = ConsumerMetrics()
        processor = Processor(app, bound, metrics, FakeSender())
        ids = [str(uuid.uuid4()) for _ in range(6)]
        assert processor.process([record(i, {"n": i}, ids[i]) for i in (0, 1, 2)]).handled == 3
        again = [record(10 + i, {"n": i}, ids[i]) for i in (1, 3, 4, 2, 5, 5)]
        assert processor.process(again).handled == 6
        with bound.connect() as conn:
            effects = sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())
        assert effects == [0, 1, 2, 3, 4, 5]
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 6
        assert metrics.registry.get_sample_value(
            "outboxkit_consumer_duplicates_total", {"topic": TOPIC}) == 3

    def test_in_batch_mode_one_failing_message_does_not_undo_the_others(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch", max_attempts=2)
        app.register(TOPIC, write)
        sender = FakeSender()
        processor = Processor(app, bound, ConsumerMetrics(), sender)
        records = [record(i, {"n": i, "fail": i == 2}) for i in range(5)]
        assert drain(processor, records) == 5
        with bound.connect() as conn:
            effects = sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())
        assert effects == [0, 1, 3, 4]
        assert [t for t, _ in sender.sent] == [f"{TOPIC}.dlq"]
        assert count(bound, "SELECT count(*) FROM outboxkit.outbox_messages") == 4

    def test_a_batch_handler_is_bisected_down_to_the_failing_message(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch", max_attempts=1)
        calls: list[int] = []

        def write_all(batch: Sequence[tuple[HandlerContext, Item]]) -> None:
            calls.append(len(batch))
            for ctx, item in batch:
                ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})
            if any(item.fail for _, item in batch):
                raise RuntimeError("one of them is bad")

        app.register_batch(TOPIC, write_all)
        sender = FakeSender()
        processor = Processor(app, bound, ConsumerMetrics(), sender)
        records = [record(i, {"n": i, "fail": i == 5}) for i in range(8)]
        assert processor.process(records).handled == 8
        with bound.connect() as conn:
            effects = sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())
        assert effects == [0, 1, 2, 3, 4, 6, 7]
        assert len(sender.sent) == 1
        assert calls[0] == 8

    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_skip_message_marks_it_handled_without_its_writes(
        self, bound: Engine, database_url: str, mode: str
    ) -> None:
        app = app_for(database_url, mode)

        def skip_odd(ctx: HandlerContext, item: Item) -> None:
            ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})
            if item.n % 2:
                raise SkipMessage("odd")

        app.register(TOPIC, skip_odd)
        metrics = ConsumerMetrics()
        processor = Processor(app, bound, metrics, FakeSender())
        assert processor.process([record(i, {"n": i}) for i in range(4)]).handled == 4
        assert count(bound, "SELECT count(*) FROM public.effects") == 2
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 4
        assert metrics.registry.get_sample_value(
            "outboxkit_consumer_skipped_total", {"topic": TOPIC}) == 2


class TestMarksAhead:
    """The next batch's marks go in with the last batch's commit (Processor.offer): what it
    handles is the same, and marks for a batch not handled as offered are rolled back."""

    @staticmethod
    def kept(app: Consumer, engine: Engine, **kwargs: Any) -> Processor:
        return Processor(app, engine, kwargs.pop("metrics", ConsumerMetrics()), FakeSender(),
                         keep_connection=True, **kwargs)

    @staticmethod
    def marked(engine: Engine) -> int:
        return count(engine, "SELECT count(*) FROM outboxkit.consumer_inbox")

    def test_the_offered_batch_is_marked_with_the_commit_and_handled_in_that_transaction(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch")
        app.register(TOPIC, write)
        committed: list[Any] = []
        processor = self.kept(app, bound, committed=committed.extend)
        first = [record(i, {"n": i}) for i in range(3)]
        second = [record(i, {"n": i}) for i in range(3, 6)]
        decoded = decode_many(second, app.registrations)
        processor.offer(second, decoded)
        try:
            assert processor.process(first).handled == 3
            # The first batch committed; the second's marks wait in an open transaction.
            assert self.marked(bound) == 3
            assert count(bound, "SELECT count(*) FROM pg_stat_activity WHERE state = "
                                "'idle in transaction' AND datname = current_database()") == 1
            assert processor.process(second, decoded=decoded).handled == 3
        finally:
            processor.release()
        assert committed == first + second
        assert self.marked(bound) == 6
        assert count(bound, "SELECT count(*) FROM public.effects") == 6

    def test_a_retry_going_first_withdraws_the_marks_ahead(self, bound: Engine,
                                                           database_url: str) -> None:
        """A retry is handled alone on another connection: the marks inserted ahead for its
        batch are rolled back first, or its own mark would wait on them (here lock_timeout
        turns that wait into a failed attempt)."""
        app = app_for(database_url, "batch")
        app.register(TOPIC, write)
        waits = create_engine(sqlalchemy_url(database_url),
                              connect_args={"options": "-c lock_timeout=2000"})
        waiting = waits.execution_options(schema_translate_map=translate(OutboxSettings()))
        processor = self.kept(app, waiting)
        first = [record(0, {"n": 0})]
        second = [record(i, {"n": i}) for i in range(1, 4)]
        decoded = decode_many(second, app.registrations)
        processor.offer(second, decoded)
        try:
            assert processor.process(first).handled == 1
            head = second[0]
            progress = processor.process(second, {(head.topic, head.partition, head.offset)},
                                         decoded=decoded)
        finally:
            processor.release()
            waits.dispose()
        assert progress.handled == 3
        assert not progress.parked
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_failures") == 0
        assert self.marked(bound) == 4

    def test_a_batch_not_handed_over_as_offered_leaves_no_marks(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch")
        app.register(TOPIC, write)
        processor = self.kept(app, bound)
        first = [record(0, {"n": 0})]
        second = [record(i, {"n": i}) for i in range(1, 4)]
        processor.offer(second, decode_many(second, app.registrations))
        try:
            assert processor.process(first).handled == 1
            processor.withdraw()  # what the runner does when it drops the batch
            assert self.marked(bound) == 1
            # Part of it, as the parking lot may keep: handled, none taken for a duplicate.
            assert processor.process(second[1:]).handled == 2
        finally:
            processor.release()
        assert self.marked(bound) == 3
        assert count(bound, "SELECT count(*) FROM public.effects") == 3

    def test_an_offered_batch_already_marked_goes_the_careful_way(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch")
        app.register(TOPIC, write)
        metrics = ConsumerMetrics()
        processor = self.kept(app, bound, metrics=metrics)
        done = [record(0, {"n": 0})]
        assert processor.process(done).handled == 1
        again = [record(1, {"n": 0}, done[0].headers[0][1].decode()), record(2, {"n": 2})]
        decoded = decode_many(again, app.registrations)
        processor.offer(again, decoded)
        try:
            assert processor.process([record(3, {"n": 3})]).handled == 1
            assert processor.process(again, decoded=decoded).handled == 2
        finally:
            processor.release()
        with bound.connect() as conn:
            effects = sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())
        assert effects == [0, 2, 3]
        assert metrics.registry.get_sample_value(
            "outboxkit_consumer_duplicates_total", {"topic": TOPIC}) == 1


class TestAttemptsSurviveRestarts:
    def test_attempts_are_counted_across_processor_instances(
        self, bound: Engine, database_url: str
    ) -> None:
        """A consumer restarted after each attempt still dead-letters after max_attempts."""
        app = app_for(database_url, "batch", max_attempts=3)
        stop = threading.Event()

        def always_fails(ctx: HandlerContext, item: Item) -> None:
            stop.set()
            raise RuntimeError("still broken")

        app.register(TOPIC, always_fails)
        sender = FakeSender()
        poison = record(0, {"n": 0})
        for _ in range(2):  # two "processes", each stopped after one attempt
            stop.clear()
            processor = Processor(app, bound, ConsumerMetrics(), sender, stop=stop)
            assert processor.process([poison]).handled == 0
        stop.clear()
        # The third process: its first attempt is the third; it dead-letters at once.
        processor = Processor(app, bound, ConsumerMetrics(), sender, stop=stop)
        assert processor.process([poison]).handled == 1
        assert len(sender.sent) == 1
        with bound.connect() as conn:
            (failure,) = list_failures(conn, group=app.group_id)
        assert failure.attempts == 3
        assert failure.status == "dead-lettered"
        assert failure.payload == poison.value


class TestParking:
    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_a_failing_message_holds_back_its_partition_only(
        self, bound: Engine, database_url: str, mode: str
    ) -> None:
        """The batch goes on with the other partitions; nothing after the failing message in
        its own partition is handled or reported committed; the message is parked, not
        waited for (process returns at once, well before its retry is due)."""
        app = app_for(database_url, mode, backoff_initial_seconds=30, backoff_max_seconds=30)
        app.register(TOPIC, write)
        committed: list[Any] = []
        processor = Processor(app, bound, ConsumerMetrics(), FakeSender(),
                              committed=committed.extend)
        records = []
        for offset in range(4):
            for partition in (0, 1, 2):
                r = record(offset, {"n": partition * 10 + offset,
                                    "fail": (partition, offset) == (1, 1)})
                r.partition = partition
                records.append(r)
        started = time.monotonic()
        progress = processor.process(records)
        assert time.monotonic() - started < 20  # the 30 s retry is not waited for
        (parked,) = progress.parked
        assert (parked.partition, parked.offset) == (1, 1)
        assert parked.due - time.monotonic() > 20
        assert progress.handled == 9  # partitions 0 and 2 whole, partition 1 up to offset 0
        with bound.connect() as conn:
            effects = sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())
        assert effects == [0, 1, 2, 3, 10, 20, 21, 22, 23]
        assert sorted((r.partition, r.offset) for r in committed) == sorted(
            [(p, o) for p in (0, 2) for o in range(4)] + [(1, 0)])

    def test_a_retry_is_handled_alone_and_first_then_its_partition_follows(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch", backoff_initial_seconds=0.05)
        seen: list[int] = []
        fail_once = {1}

        def flaky(ctx: HandlerContext, item: Item) -> None:
            seen.append(item.n)
            if item.n in fail_once:
                fail_once.discard(item.n)
                raise RuntimeError("not yet")
            write(ctx, item)

        app.register(TOPIC, flaky)
        processor = Processor(app, bound, ConsumerMetrics(), FakeSender())
        records = [record(i, {"n": i}) for i in range(4)]
        assert drain(processor, records) == 4
        # The plain batch fails at 1 and its prefix [0] runs again alone; then 1 is retried
        # alone, before the records behind it.
        assert seen == [0, 1, 0, 1, 2, 3]
        with bound.connect() as conn:
            (failure,) = list_failures(conn, group=app.group_id, status=None)
        assert (failure.attempts, failure.status) == (1, "recovered")


class TestAwaitedOperations:
    def test_a_message_whose_operation_is_open_is_not_dead_lettered_until_it_settles(
        self, bound: Engine, database_url: str
    ) -> None:
        """max_attempts is spent, but the ledger still expects the outcome of the operation
        the message started: the message waits for it instead of going to the dead-letter
        topic, and is handled once the operation settled."""
        app = app_for(database_url, "batch", max_attempts=2, backoff_initial_seconds=0.05,
                      backoff_max_seconds=0.1)
        outcomes: list[str] = []

        def place(ctx: HandlerContext, item: Item) -> None:
            with bound.begin() as conn:  # the intent commits on its own, as perform's does
                intent = LEDGER.begin(conn, key=f"place:{ctx.message_id}", system="supplier",
                                      operation="place", request={"n": item.n},
                                      message_id=ctx.message_id, in_flight_grace=0.0)
            outcomes.append(intent.operation.status.value)
            if intent.operation.status.value != "confirmed":
                raise RetryLater("the order's outcome is not known yet")
            write(ctx, item)

        app.register(TOPIC, place)
        sender = FakeSender()
        processor = Processor(app, bound, ConsumerMetrics(), sender)
        poison = record(0, {"n": 7})
        progress = processor.process([poison])
        for _ in range(4):  # attempts 2..5: over max_attempts, still parked
            (parked,) = progress.parked
            time.sleep(max(0.0, parked.due - time.monotonic()))
            progress = processor.process([poison], {(TOPIC, 0, 0)})
        assert sender.sent == []
        assert progress.handled == 0
        message_id = poison.headers[0][1].decode()
        with bound.begin() as conn:
            op = LEDGER.get_operation(conn, key=f"place:{message_id}")
            LEDGER.record_outcome(conn, op.id, Applied(Evidence(reference="SUP-1")))
        (parked,) = progress.parked
        time.sleep(max(0.0, parked.due - time.monotonic()))
        assert processor.process([poison], {(TOPIC, 0, 0)}).handled == 1
        assert sender.sent == []
        assert count(bound, "SELECT count(*) FROM public.effects") == 1
        assert outcomes[-1] == "confirmed"

    def test_without_an_open_operation_the_budget_still_dead_letters(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch", max_attempts=2, backoff_initial_seconds=0.05)

        def refuse(ctx: HandlerContext, item: Item) -> None:
            raise RetryLater("the supplier is down")

        app.register(TOPIC, refuse)
        sender = FakeSender()
        assert drain(Processor(app, bound, ConsumerMetrics(), sender), [record(0, {"n": 1})]) == 1
        assert [t for t, _ in sender.sent] == [f"{TOPIC}.dlq"]
