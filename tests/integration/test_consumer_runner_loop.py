"""The runner's loop around the marks inserted ahead (Processor.offer/withdraw), and what
run() does to the interpreter's switch interval: the real Runner on real PostgreSQL, its
Kafka client a scripted stand-in (each poll returns the next batch given), so that a batch
is polled exactly while the one before it is in hand."""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

import consumers.processing
import consumers.runner
from consumers import Consumer, HandlerContext, Runner
from consumers.parking import Parked
from outbox.kafka import Record, TopicPartition
from tests.e2e.consumer_support import settings

TOPIC = "items"
FAILING = 5  # its handler always fails

IDLE_IN_TRANSACTION = ("SELECT count(*) FROM pg_stat_activity WHERE state = "
                       "'idle in transaction' AND datname = current_database()")


class Item(BaseModel):
    n: int


def record(partition: int, offset: int, n: int) -> Record:
    headers = [("message-id", str(uuid.uuid4()).encode())]
    return Record(TOPIC, partition, offset, -1, b"k", json.dumps({"n": n}).encode(), headers)


class ScriptedKafka:
    """The runner's Kafka client: poll *k* runs ``hooks[k]`` (on the loop's thread), then
    returns the next of ``batches``, or nothing once they are all taken; the first poll after
    a seek returns ``again`` instead, if given (what was read again from there)."""

    def __init__(self, partitions: int = 2) -> None:
        self.assigned = {TopicPartition(TOPIC, p) for p in range(partitions)}
        self.batches: list[list[Record]] = []
        self.hooks: dict[int, Callable[[], None]] = {}
        self.polls = 0
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.again: list[Record] | None = None
        self._sought = False
        self._paused: set[TopicPartition] = set()

    def poll(self, timeout_ms: int, max_records: int) -> list[Record]:
        self.polls += 1
        hook = self.hooks.get(self.polls)
        if hook is not None:
            hook()
        if self._sought and self.again is not None:
            again, self.again, self._sought = self.again, None, False
            return again
        if self.batches:
            return self.batches.pop(0)
        time.sleep(0.01)
        return []

    def subscribe(self, topics: Any, listener: Any) -> None:
        pass

    def unsubscribe(self) -> None:
        pass

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        pass

    def commit_async(self, offsets: Mapping[TopicPartition, int], callback: Any) -> None:
        callback(offsets, None)

    def member_id(self) -> str | None:
        return "scripted"

    def pause(self, *partitions: TopicPartition) -> None:
        self._paused.update(partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self._paused.difference_update(partitions)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def seek(self, partition: TopicPartition, offset: int) -> None:
        self.seeks.append((partition, offset))
        self._sought = True

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def position(self, partition: TopicPartition) -> int | None:
        return None

    def highwater(self, partition: TopicPartition) -> int | None:
        return None

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return {tp.partition for tp in self.assigned}

    def close(self) -> None:
        pass


@pytest.fixture
def effects(engine: Engine) -> Callable[[], list[int]]:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.effects (n integer NOT NULL)"))

    def read() -> list[int]:
        with engine.connect() as conn:
            return sorted(conn.execute(text("SELECT n FROM public.effects")).scalars())

    return read


@pytest.fixture
def pipelined(monkeypatch: pytest.MonkeyPatch) -> list[bool | None]:
    """What each commit taking the next batch's marks answered (True: they went in)."""
    answers: list[bool | None] = []
    real = consumers.processing.commit_then_insert_new

    def spy(*args: Any, **kwargs: Any) -> bool | None:
        answers.append(real(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(consumers.processing, "commit_then_insert_new", spy)
    return answers


def make_runner(
    database_url: str, kafka: ScriptedKafka, monkeypatch: pytest.MonkeyPatch, *,
    own_process: bool = False, **overrides: Any,
) -> tuple[Runner, threading.Event]:
    """A runner whose first handled message (n == 0) waits until the loop offered the batch
    polled behind it: that batch's marks then go in with its commit. Message 5 always fails."""
    app = Consumer(f"g-{uuid.uuid4().hex[:6]}", settings=settings(
        database_url, "127.0.0.1:1", dedup_retention_seconds=0, watchdog_session_timeouts=0,
        **overrides))
    offered = threading.Event()

    def write(ctx: HandlerContext, item: Item) -> None:
        if item.n == 0:
            assert offered.wait(5), "the loop offered no batch"
        if item.n == FAILING:
            raise RuntimeError("supplier down")
        ctx.conn.execute(text("INSERT INTO public.effects (n) VALUES (:n)"), {"n": item.n})

    app.register(TOPIC, write)
    monkeypatch.setattr(consumers.runner, "_freeze_startup_objects", lambda: None)
    runner = Runner(app, own_process=own_process)
    runner._make_consumer = lambda: kafka  # type: ignore[method-assign]
    offer = runner.processor.offer

    def offering(records: Any, decoding: Any = None, **kwargs: Any) -> None:
        offer(records, decoding, **kwargs)
        if records is not None:
            offered.set()

    runner.processor.offer = offering  # type: ignore[method-assign]
    return runner, offered


@contextmanager
def running(runner: Runner) -> Iterator[list[BaseException]]:
    """run() in a thread; stopped and joined at the end (the errors it raised, listed)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        runner.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the runner did not stop"


def looking(engine: Engine, runner: Runner, seen: list[int], done: threading.Event
            ) -> Callable[[], None]:
    """A poll's hook: once what the loop gave the handler thread is done, the sessions idle
    in a transaction (marks held ahead) are counted."""

    def look() -> None:
        assert runner._handler_thread is not None
        runner._handler_thread.submit(lambda: None).result(timeout=10)
        with engine.connect() as conn:
            seen.append(int(conn.execute(text(IDLE_IN_TRANSACTION)).scalar_one()))
        done.set()

    return look


def run_until_looked(engine: Engine, runner: Runner, kafka: ScriptedKafka, poll: int
                     ) -> list[int]:
    """Run the loop until its poll *poll* looked (see ``looking``), then stop it: the
    sessions idle in a transaction that the look counted."""
    seen: list[int] = []
    done = threading.Event()
    kafka.hooks[poll] = looking(engine, runner, seen, done)
    with running(runner) as errors:
        assert done.wait(10)
    assert not errors
    return seen


def marked(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outboxkit.consumer_inbox"))
                   .scalar_one())


class TestMarksAheadNotHandedOver:
    """A batch polled while the one before it was in hand is queued behind it; records the
    parking lot holds back are neither offered nor handled, and marks inserted ahead with
    that one's commit for a batch not handled as offered are rolled back."""

    @staticmethod
    def behind_a_parked_partition(
        engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch,
        second: list[Record], *, offered_too: bool = True,
    ) -> list[int]:
        """Run the loop on a batch of partition 0, then *second*, with partition 1 parked;
        the sessions idle in a transaction that the third poll counted (see ``looking``).
        *offered_too*: some of *second* is offered (else the first batch waits for none)."""
        kafka = ScriptedKafka()
        runner, offered = make_runner(database_url, kafka, monkeypatch)
        if not offered_too:
            offered.set()
        runner.parking.park(kafka, Parked(TOPIC, 1, 0, time.monotonic() + 600))
        kafka.batches = [[record(0, 0, 0), record(0, 1, 1)], second]
        return run_until_looked(engine, runner, kafka, 3)

    def test_a_batch_kept_back_whole_by_the_parking_lot(
        self, engine: Engine, database_url: str, effects: Callable[[], list[int]],
        pipelined: list[bool | None], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """All of it is of a parked partition (fetched before the pause took effect):
        nothing is offered, nothing handed over, nothing marked."""
        seen = self.behind_a_parked_partition(
            engine, database_url, monkeypatch, [record(1, 0, 10), record(1, 1, 11)],
            offered_too=False)
        assert pipelined == []
        assert seen == [0]
        assert effects() == [0, 1]
        assert marked(engine) == 2

    def test_a_batch_handed_over_in_part(
        self, engine: Engine, database_url: str, effects: Callable[[], list[int]],
        pipelined: list[bool | None], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Part of it is of a parked partition: the rest is offered, its marks go in with the
        commit before and it is handled; the parked records are neither handled nor marked."""
        seen = self.behind_a_parked_partition(
            engine, database_url, monkeypatch, [record(0, 2, 2), record(1, 0, 10)])
        assert pipelined == [True]
        assert seen == [0]
        assert effects() == [0, 1, 2]
        assert marked(engine) == 3

    def test_a_batch_queued_behind_one_that_parks_a_partition(
        self, engine: Engine, database_url: str, effects: Callable[[], list[int]],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The batch in hand parks partition 1 while the next one, queued behind it, holds
        that partition's next record, and the one after, polled but not queued yet, the
        record after it: the handler thread leaves the first out, the loop the second (the
        park seeks the partition back, so they are read again after the retry), and the
        rest is handled."""
        kafka = ScriptedKafka()
        runner, _ = make_runner(database_url, kafka, monkeypatch, backoff_initial_seconds=60,
                                backoff_max_seconds=60)
        kafka.batches = [[record(1, 0, FAILING), record(0, 0, 0)],
                         [record(1, 1, 6), record(0, 1, 1)],
                         [record(1, 2, 7), record(0, 2, 2)]]
        seen = run_until_looked(engine, runner, kafka, 4)
        assert effects() == [0, 1, 2]  # 6 and 7 wait behind 5, parked
        assert (TopicPartition(TOPIC, 1), 0) in kafka.seeks
        assert seen == [0]
        assert marked(engine) == 3

    def test_a_batch_dropped_because_the_one_before_failed_after_its_commit(
        self, engine: Engine, database_url: str, effects: Callable[[], list[int]],
        pipelined: list[bool | None], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The batch in hand committed (with the next one's marks), then failed: both are
        read again from the first one; no marks are held meanwhile, and each message has
        its effect once. (process() withdraws them as it fails, and the loop has them
        withdrawn as it drops the batch: either is enough.)"""
        kafka = ScriptedKafka(partitions=1)
        runner, _ = make_runner(database_url, kafka, monkeypatch)
        committed = runner.processor.committed
        failed: list[int] = []

        def fail_once(records: Any) -> None:
            committed(records)
            if not failed:
                failed.append(len(records))
                raise RuntimeError("after the commit")

        runner.processor.committed = fail_once
        first = [record(0, 0, 0), record(0, 1, 1)]
        second = [record(0, 2, 2), record(0, 3, 3)]
        kafka.batches = [first, second]
        kafka.again = first + second
        seen: list[int] = []
        done = threading.Event()
        kafka.hooks[3] = looking(engine, runner, seen, done)
        with running(runner) as errors:
            assert done.wait(10)
            deadline = time.monotonic() + 10
            while effects() != [0, 1, 2, 3] and time.monotonic() < deadline:
                time.sleep(0.02)
        assert not errors
        assert failed == [2]
        assert pipelined[0] is True
        assert kafka.seeks[0] == (TopicPartition(TOPIC, 0), 2)  # the first batch committed
        assert seen == [0]
        assert effects() == [0, 1, 2, 3]
        assert marked(engine) == 4


def test_a_batch_queued_behind_one_that_failed_waits_for_it(
    engine: Engine, database_url: str, effects: Callable[[], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch in hand fails before its commit while the next one is queued behind it and
    a third polled: neither is handled ahead of it, all are read again in order (a key's
    effects never commit out of order), and the third's offer is not left behind."""
    kafka = ScriptedKafka(partitions=1)
    runner, _ = make_runner(database_url, kafka, monkeypatch)
    first = [record(0, 0, 0), record(0, 1, 1)]
    second = [record(0, 2, 2), record(0, 3, 3)]
    third = [record(0, 4, 4)]
    kafka.batches = [first, second, third]
    kafka.again = first + second + third
    process = runner.processor.process
    calls: list[list[int]] = []

    def failing_once(records: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append([r.offset for r in records])
        if len(calls) == 1:
            raise RuntimeError("the database went away")
        return process(records, *args, **kwargs)

    monkeypatch.setattr(runner.processor, "process", failing_once)
    with running(runner) as errors:
        deadline = time.monotonic() + 10
        while effects() != [0, 1, 2, 3, 4] and time.monotonic() < deadline:
            time.sleep(0.02)
        offers_left = dict(runner.processor._offers)
    assert not errors
    assert calls[:2] == [[0, 1], [0, 1, 2, 3, 4]]
    assert kafka.seeks[0] == (TopicPartition(TOPIC, 0), 0)
    assert effects() == [0, 1, 2, 3, 4]
    assert offers_left == {}


@pytest.mark.parametrize("ending", ["stopped", "failed"])
def test_run_gives_the_switch_interval_back(
    database_url: str, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """Run as its own process with kafka-python, the loop runs with a 0.5 ms switch interval;
    run() puts back the one before when it returns, or when its loop failed."""
    kafka = ScriptedKafka()
    runner, _ = make_runner(database_url, kafka, monkeypatch, own_process=True,
                            kafka_client="kafka-python")
    before = sys.getswitchinterval()
    during: list[float] = []
    done = threading.Event()

    def look() -> None:
        during.append(sys.getswitchinterval())
        done.set()

    def fail() -> None:
        raise RuntimeError("the loop failed")

    kafka.hooks[1] = look
    if ending == "failed":
        kafka.hooks[2] = fail
    try:
        with running(runner) as errors:
            assert done.wait(10)
            if ending == "failed":
                deadline = time.monotonic() + 10
                while not errors and time.monotonic() < deadline:
                    time.sleep(0.01)
        after = sys.getswitchinterval()
    finally:
        sys.setswitchinterval(before)
    assert during == [pytest.approx(0.0005)]
    assert after == before
    assert [str(e) for e in errors] == (["the loop failed"] if ending == "failed" else [])


def test_marks_ahead_of_a_batch_never_handed_over_go_before_the_client_leaves(
    engine: Engine, database_url: str, effects: Callable[[], list[int]],
    pipelined: list[bool | None], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop fails right after the batch in hand committed with the next one's marks,
    the next one queued but not started: it is dropped unhandled, and its marks are gone
    when the client leaves its group (others may read those messages then), not only at
    the connection's release after it."""
    kafka = ScriptedKafka(partitions=1)
    runner, _ = make_runner(database_url, kafka, monkeypatch)
    second = [record(0, 2, 2), record(0, 3, 3)]
    kafka.batches = [[record(0, 0, 0), record(0, 1, 1)], second]
    handled = runner.parking.handled

    def fail(retries: Any) -> None:
        handled(retries)
        raise RuntimeError("after the batch")

    retract = runner.processor.retract_offer

    def held_back(records: Any) -> None:
        if records is second:  # the queued batch starts only once the loop is closing
            assert runner._closing_loop.wait(10)
        retract(records)

    monkeypatch.setattr(runner.parking, "handled", fail)
    monkeypatch.setattr(runner.processor, "retract_offer", held_back)
    held_at_leave: list[int] = []

    def leave() -> None:
        with engine.connect() as conn:
            held_at_leave.append(int(conn.execute(text(IDLE_IN_TRANSACTION)).scalar_one()))

    monkeypatch.setattr(kafka, "close", leave)
    with pytest.raises(RuntimeError, match="after the batch"):
        runner.run()
    assert pipelined == [True]  # the second batch's marks went in with the first's commit
    assert held_at_leave == [0]
    assert effects() == [0, 1]
    assert marked(engine) == 2
