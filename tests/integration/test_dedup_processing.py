"""The consumer's processing core on real PostgreSQL (records built by hand, no Kafka)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from consumers import Consumer, HandlerContext, SkipMessage
from consumers.deadletter import Sent
from consumers.metrics import ConsumerMetrics
from consumers.processing import Processor
from dedup.failures import list_failures
from outbox.envelope import Envelope
from outbox.schema import translate
from outbox.settings import OutboxSettings
from tests.e2e.consumer_support import settings

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


def write(ctx: HandlerContext, item: Item) -> None:
    ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})
    ctx.emit(Envelope(topic="follow-up", type="t", key="k", payload={"n": item.n}))
    if item.fail:
        raise RuntimeError("boom")


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

        app.register(TOPIC, Item, fail_then_stop)
        processor = Processor(app, bound, ConsumerMetrics(), FakeSender(), stop=stop)
        assert processor.process([record(0, {"n": 1})]) == 0
        assert count(bound, "SELECT count(*) FROM public.effects") == 0
        assert count(bound, "SELECT count(*) FROM outboxkit.outbox_messages") == 0
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 0
        assert count(bound, "SELECT attempts FROM outboxkit.consumer_failures") == 1

    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_a_handled_message_commits_effect_mark_and_follow_up_together(
        self, bound: Engine, database_url: str, mode: str
    ) -> None:
        app = app_for(database_url, mode)
        app.register(TOPIC, Item, write)
        committed: list[Any] = []
        processor = Processor(
            app, bound, ConsumerMetrics(), FakeSender(), committed=committed.extend
        )
        records = [record(i, {"n": i}) for i in range(5)]
        assert processor.process(records) == 5
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
            app.register_batch(TOPIC, Item, lambda batch: [write(c, i) for c, i in batch])
        else:
            app.register(TOPIC, Item, write)
        metrics = ConsumerMetrics()
        processor = Processor(app, bound, metrics, FakeSender())
        ids = [str(uuid.uuid4()) for _ in range(6)]
        assert processor.process([record(i, {"n": i}, ids[i]) for i in (0, 1, 2)]) == 3
        again = [record(10 + i, {"n": i}, ids[i]) for i in (1, 3, 4, 2, 5, 5)]
        assert processor.process(again) == 6
        with bound.connect() as conn:
            effects = sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())
        assert effects == [0, 1, 2, 3, 4, 5]
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 6
        assert metrics.duplicates.labels(TOPIC)._value.get() == 3

    def test_in_batch_mode_one_failing_message_does_not_undo_the_others(
        self, bound: Engine, database_url: str
    ) -> None:
        app = app_for(database_url, "batch", max_attempts=2)
        app.register(TOPIC, Item, write)
        sender = FakeSender()
        processor = Processor(app, bound, ConsumerMetrics(), sender)
        records = [record(i, {"n": i, "fail": i == 2}) for i in range(5)]
        assert processor.process(records) == 5
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

        app.register_batch(TOPIC, Item, write_all)
        sender = FakeSender()
        processor = Processor(app, bound, ConsumerMetrics(), sender)
        records = [record(i, {"n": i, "fail": i == 5}) for i in range(8)]
        assert processor.process(records) == 8
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

        app.register(TOPIC, Item, skip_odd)
        metrics = ConsumerMetrics()
        processor = Processor(app, bound, metrics, FakeSender())
        assert processor.process([record(i, {"n": i}) for i in range(4)]) == 4
        assert count(bound, "SELECT count(*) FROM public.effects") == 2
        assert count(bound, "SELECT count(*) FROM outboxkit.consumer_inbox") == 4
        assert metrics.skipped.labels(TOPIC)._value.get() == 2


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

        app.register(TOPIC, Item, always_fails)
        sender = FakeSender()
        poison = record(0, {"n": 0})
        for _ in range(2):  # two "processes", each stopped after one attempt
            stop.clear()
            assert (
                Processor(app, bound, ConsumerMetrics(), sender, stop=stop).process([poison]) == 0
            )
        stop.clear()
        # The third process: its first attempt is the third; it dead-letters at once.
        assert Processor(app, bound, ConsumerMetrics(), sender, stop=stop).process([poison]) == 1
        assert len(sender.sent) == 1
        with bound.connect() as conn:
            (failure,) = list_failures(conn, group=app.group_id)
        assert failure.attempts == 3
        assert failure.status == "dead-lettered"
        assert failure.payload == poison.value
