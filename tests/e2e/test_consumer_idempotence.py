"""An idempotent consumer against real Kafka and PostgreSQL: effects once, poison set aside."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kafka import KafkaConsumer, OffsetAndMetadata, TopicPartition
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from consumers import Consumer, HandlerContext, RetryLater, rehandle, republish
from consumers.deadletter import KafkaSender
from consumers.failures import list_failures
from consumers.processing import Progress
from outbox.db.schema import translate
from outbox.settings import OutboxSettings
from tests.e2e.conftest import read_topic, wait_until
from tests.e2e.consumer_app import Item, handle
from tests.e2e.consumer_support import (
    InProcess,
    create_effects,
    effects,
    produce,
    sample,
    settings,
)

pytestmark = pytest.mark.timeout(180)


def make_app(
    database_url: str,
    bootstrap: str,
    topic: str,
    handler: Callable[[HandlerContext, Item], None] = handle,
    **overrides: object,
) -> Consumer:
    app = Consumer(
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        settings=settings(database_url, bootstrap, **overrides),
    )
    app.register(topic, handler)
    return app


class TestRedelivery:
    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_the_same_message_delivered_twice_has_its_effect_once(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
        mode: str,
    ) -> None:
        """Each message is in the topic twice (a relay re-send); every effect happens once."""
        topic = kafka_topic(partitions=3)
        create_effects(engine)
        ids = [str(uuid.uuid4()) for _ in range(50)]
        produce(kafka_bootstrap, topic, [{"n": i} for i in range(50)], message_ids=list(ids))
        produce(kafka_bootstrap, topic, [{"n": i} for i in range(50)], message_ids=list(ids))
        app = make_app(database_url, kafka_bootstrap, topic, mode=mode)
        with InProcess(app) as running:
            metrics = running.runner.metrics
            wait_until(
                lambda: (
                    sample(metrics, "duplicates_total", topic=topic) >= 50
                    and sample(metrics, "processed_total", topic=topic) >= 50
                ),
                60,
                "50 processed and 50 duplicates dropped",
            )
            processed = sample(metrics, "processed_total", topic=topic)
        assert effects(engine) == dict.fromkeys(ids, 1)
        assert processed == 50

    def test_offsets_rewound_to_zero_redeliver_everything_and_redo_nothing(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
    ) -> None:
        """The group's offsets rewound (marks kept): every message comes again, none is redone."""
        topic = kafka_topic(partitions=2)
        create_effects(engine)
        ids = produce(kafka_bootstrap, topic, [{"n": i} for i in range(30)])
        app = make_app(database_url, kafka_bootstrap, topic)
        with InProcess(app) as running:
            wait_until(lambda: len(effects(engine)) == 30, 60, "30 effects")
            del running
        # Rewind the group's committed offsets to 0: Kafka redelivers everything.
        rewind = KafkaConsumer(
            bootstrap_servers=kafka_bootstrap, group_id=app.group_id, enable_auto_commit=False
        )
        try:
            partitions = [TopicPartition(topic, p) for p in (0, 1)]
            rewind.assign(partitions)
            rewind.commit({tp: OffsetAndMetadata(0, "", -1) for tp in partitions})
        finally:
            rewind.close()
        again = Consumer(group_id=app.group_id, settings=app.settings)
        again.register(topic, handle)
        with InProcess(again) as running:
            wait_until(
                lambda: sample(running.runner.metrics, "duplicates_total", topic=topic) >= 30,
                60,
                "30 duplicates dropped",
            )
        assert effects(engine) == dict.fromkeys(ids, 1)


class TestPipelinedLoop:
    def test_a_batch_that_fails_as_a_whole_is_read_again_with_the_one_polled_behind_it(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
    ) -> None:
        """While batch N is handled, N+1 is already queued and N+2 polled; if N fails (the
        database went away, say), neither may be handled before N's records: all are read
        again."""
        topic = kafka_topic(partitions=1)
        create_effects(engine)
        produce(kafka_bootstrap, topic, [{"n": i} for i in range(120)], partition=0)
        handled: list[int] = []
        threads: set[str] = set()

        def record(ctx: HandlerContext, item: Item) -> None:
            handled.append(ctx.offset)
            threads.add(threading.current_thread().name)
            handle(ctx, item)

        app = make_app(database_url, kafka_bootstrap, topic, record, max_poll_records=10)
        running = InProcess(app)
        processor = running.runner.processor
        real = processor.process
        calls = [0]

        def failing_third_batch(records: Any, retries: Any = (), unsure: Any = (),
                                decoded: Any = None, **kwargs: Any) -> Progress:
            calls[0] += 1
            if calls[0] == 3:
                raise OperationalError("SELECT 1", {}, Exception("the database went away"))
            return real(records, retries, unsure, decoded, **kwargs)

        processor.process = failing_third_batch  # type: ignore[method-assign]
        with running:
            wait_until(lambda: len(effects(engine)) >= 120, 60, "120 effects")
        assert calls[0] >= 4
        assert handled == list(range(120)), "each record handled once, in offset order"
        assert set(effects(engine).values()) == {1}
        assert len(threads) == 1  # every handler on the one handler thread


    def test_members_joining_and_leaving_while_batches_are_queued(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
    ) -> None:
        """A second member joins the group, then leaves, while the first has a batch in hand,
        one queued behind it and one polled: every message has its effect once, and each
        partition's handlers run in offset order across the two members (a partition's
        records queued on the member that lost it wait on, or drop as, duplicates of the
        new owner's)."""
        topic = kafka_topic(partitions=4)
        create_effects(engine)
        ids = produce(kafka_bootstrap, topic, [{"n": i} for i in range(1600)])
        calls: list[tuple[int, int]] = []
        lock = threading.Lock()

        def record(ctx: HandlerContext, item: Item) -> None:
            with lock:
                calls.append((ctx.partition, ctx.offset))
            handle(ctx, item)
            time.sleep(0.004)  # about 6 s of work: the rebalances come while it flows

        first = make_app(database_url, kafka_bootstrap, topic, record, max_poll_records=50)
        second = Consumer(group_id=first.group_id, settings=first.settings)
        second.register(topic, record)
        with InProcess(first):
            wait_until(lambda: len(effects(engine)) >= 300, 60, "300 effects")
            with InProcess(second) as joined:
                wait_until(lambda: sample(joined.runner.metrics, "processed_total",
                                          topic=topic) >= 100, 60, "the second member working")
            wait_until(lambda: len(effects(engine)) >= 1600, 90, "1600 effects")
        assert effects(engine) == dict.fromkeys(ids, 1)
        by_partition: dict[int, list[int]] = {}
        for partition, offset in calls:
            by_partition.setdefault(partition, []).append(offset)
        assert sorted(by_partition) == [0, 1, 2, 3]
        for partition, offsets in by_partition.items():
            assert offsets == sorted(set(offsets)), f"partition {partition} out of order"


class TestRetryIsolation:
    @pytest.mark.parametrize("mode", ["batch", "per-message"])
    def test_a_partition_waiting_on_a_retry_does_not_hold_up_the_others(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
        mode: str,
    ) -> None:
        """Partition 0's first message keeps failing (its outside system hangs): the other
        partitions are handled in full meanwhile; partition 0's messages wait behind it, its
        committed offset stays at it, and once it succeeds the partition follows in order."""
        topic = kafka_topic(partitions=3)
        create_effects(engine)
        for partition in range(3):
            produce(kafka_bootstrap, topic, [{"n": partition * 100 + i} for i in range(20)],
                    partition=partition)
        supplier_back = threading.Event()
        handled: list[tuple[int, int]] = []

        def record(ctx: HandlerContext, item: Item) -> None:
            if item.n == 0 and not supplier_back.is_set():
                raise RetryLater("the supplier hangs", 0.2)
            handled.append((ctx.partition, ctx.offset))
            handle(ctx, item)

        app = make_app(database_url, kafka_bootstrap, topic, record, mode=mode,
                       max_attempts=1000, max_poll_records=7)
        with InProcess(app) as running:
            wait_until(lambda: len(effects(engine)) >= 40, 60, "partitions 1 and 2 handled")
            assert not [h for h in handled if h[0] == 0]
            # The loop sets the gauge once it collected the batch that parked partition 0.
            wait_until(lambda: sample(running.runner.metrics, "parked_partitions") == 1, 10,
                       "partition 0 counted as held back")
            # Nothing of partition 0 is done, so no offset past its first is there to commit.
            assert running.runner.offsets.pending.get(TopicPartition(topic, 0), 0) == 0
            supplier_back.set()
            wait_until(lambda: len(effects(engine)) >= 60, 60, "partition 0 handled")
        assert [o for p, o in handled if p == 0] == list(range(20))
        assert set(effects(engine).values()) == {1}


class TestPoisonMessages:
    def test_poison_goes_to_the_dead_letter_topic_and_the_messages_behind_it_are_processed(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
    ) -> None:
        topic = kafka_topic(partitions=1)
        kafka_topic(name=f"{topic}.dlq")
        create_effects(engine)
        items: list[dict[str, object] | bytes] = [
            {"n": 0},
            b"not json",
            {"n": 2, "fail": "always"},
            {"wrong": "schema"},
            {"n": 4},  # sent without a message-id header below
            {"n": 5, "fail": "dead-letter"},
            {"n": 6, "fail": "once"},
            {"n": 7},
        ]
        ids: list[str | None] = [str(uuid.uuid4()) for _ in items]
        ids[4] = None
        produce(kafka_bootstrap, topic, items, message_ids=ids, partition=0)
        app = make_app(database_url, kafka_bootstrap, topic, max_attempts=3)
        with InProcess(app) as running:
            wait_until(
                lambda: sample(running.runner.metrics, "dead_lettered_total", topic=topic) >= 5,
                60,
                "5 dead letters",
            )
            wait_until(lambda: len(effects(engine)) == 3, 30, "the good messages' effects")
        assert effects(engine) == {ids[0]: 1, ids[6]: 1, ids[7]: 1}

        dead = read_topic(kafka_bootstrap, f"{topic}.dlq")
        assert sorted(r.offset for r in dead) == list(range(5))
        by_offset = {
            int(dict(r.headers)["x-outboxkit-original-offset"]): dict(r.headers) for r in dead
        }
        assert sorted(by_offset) == [1, 2, 3, 4, 5]
        assert by_offset[2]["x-outboxkit-attempts"] == b"3"
        assert b"always fails" in by_offset[2]["x-outboxkit-error"]
        assert b"not JSON" in by_offset[1]["x-outboxkit-error"]
        assert b"message-id" in by_offset[4]["x-outboxkit-error"]
        assert all(h["x-outboxkit-original-topic"] == topic.encode() for h in by_offset.values())

        bound = engine.execution_options(schema_translate_map=translate(OutboxSettings()))
        with bound.connect() as conn:
            failed = list_failures(conn, group=app.group_id, status=None)
        assert {f.offset: f.status for f in failed} == {
            1: "dead-lettered",
            2: "dead-lettered",
            3: "dead-lettered",
            4: "dead-lettered",
            5: "dead-lettered",
            6: "recovered",
        }
        assert next(f for f in failed if f.offset == 2).attempts == 3


class TestFollowUps:
    def test_a_follow_up_is_emitted_in_the_handlers_transaction(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
    ) -> None:
        """Committed: mark and follow-up together. Rolled back: neither."""
        topic = kafka_topic(partitions=1)
        kafka_topic(name=f"{topic}.dlq")
        create_effects(engine)
        ids = produce(
            kafka_bootstrap,
            topic,
            [{"n": 1, "follow_up": "next"}, {"n": 2, "follow_up": "next", "fail": "always"}],
            partition=0,
        )
        app = make_app(database_url, kafka_bootstrap, topic, max_attempts=2)
        with InProcess(app) as running:
            wait_until(
                lambda: sample(running.runner.metrics, "dead_lettered_total", topic=topic) >= 1,
                60,
                "the failing message dead-lettered",
            )
        with engine.connect() as conn:
            follow_ups = (
                conn.execute(
                    text(
                        "SELECT causation_id FROM ("
                        " SELECT headers->>'causation-id' AS causation_id"
                        " FROM outboxkit.outbox_messages WHERE topic = 'next') s"
                    )
                )
                .scalars()
                .all()
            )
            marks = (
                conn.execute(
                    text(
                        "SELECT message_id FROM outboxkit.consumer_inbox WHERE consumer_group = :g"
                    ),
                    {"g": app.group_id},
                )
                .scalars()
                .all()
            )
        assert follow_ups == [ids[0]]
        # The dead-lettered message is marked (so redeliveries drop) but left no effect.
        assert sorted(marks) == sorted([ids[0], ids[1]])
        assert effects(engine) == {ids[0]: 1}


class TestReplay:
    def test_dead_letters_can_be_republished_or_rehandled_once_the_cause_is_fixed(
        self,
        engine: Engine,
        database_url: str,
        kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
    ) -> None:
        topic = kafka_topic(partitions=1)
        kafka_topic(name=f"{topic}.dlq")
        create_effects(engine)
        ids = produce(
            kafka_bootstrap, topic, [{"n": 1, "fail": "always"}, {"n": 2, "fail": "always"}]
        )
        app = make_app(database_url, kafka_bootstrap, topic, max_attempts=1)
        with InProcess(app) as running:
            wait_until(
                lambda: sample(running.runner.metrics, "dead_lettered_total", topic=topic) >= 2,
                60,
                "2 dead letters",
            )
        bound = engine.execution_options(schema_translate_map=translate(OutboxSettings()))
        with bound.connect() as conn:
            first, second = list_failures(conn, group=app.group_id)

        fixed = Consumer(group_id=app.group_id, settings=app.settings)
        def handle_fixed(ctx: HandlerContext, item: Item) -> None:
            handle(ctx, item.model_copy(update={"fail": None}))

        fixed.register(topic, handle_fixed)
        rehandle(fixed, bound, first.id)
        assert effects(engine) == {ids[0]: 1}

        sender = KafkaSender(app.settings.kafka(), client_id="replay-test")
        try:
            republish(bound, sender, second.id)
        finally:
            sender.close()
        with InProcess(fixed) as running:
            wait_until(lambda: len(effects(engine)) == 2, 60, "the republished message handled")
        assert effects(engine) == dict.fromkeys(ids, 1)
        with bound.connect() as conn:
            statuses = {f.id: f.status for f in list_failures(conn, status=None)}
        assert statuses == {first.id: "replayed", second.id: "replayed"}
