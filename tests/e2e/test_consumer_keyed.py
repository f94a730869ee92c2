"""Per-message mode against real Kafka and PostgreSQL: keys of one partition at the same
time, each key in offset order, a failing key holding up only itself, crashes and
rebalances with messages in flight."""

from __future__ import annotations

import json
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from kafka import KafkaProducer
from sqlalchemy import Engine, text

from consumers import Consumer
from tests.e2e.conftest import wait_until
from tests.e2e.consumer_support import (
    ConsumerProcesses,
    InProcess,
    sample,
    settings,
    wait_for_group,
)
from tests.e2e.keyed_app import EFFECTS_DDL, handle

pytestmark = pytest.mark.timeout(240)


def produce_keyed(bootstrap: str, topic: str, items: list[tuple[str | None, int]],
                  *, big_key: bytes | None = None) -> list[str]:
    """Send ``{"key": k, "seq": i}`` under Kafka key *k*, in order; the message ids."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5,
                             max_request_size=4 * 1024 * 1024)
    ids, sent = [], []
    try:
        for key, seq in items:
            message_id = str(uuid.uuid4())
            ids.append(message_id)
            kafka_key = big_key if key == "big" and big_key else (
                None if key is None else key.encode())
            sent.append(producer.send(
                topic, key=kafka_key, value=json.dumps({"key": key, "seq": seq}).encode(),
                headers=[("message-id", message_id.encode())]))
        producer.flush(timeout=60)
        for future in sent:
            future.get(timeout=10)  # refused records would make the test wait for nothing
    finally:
        producer.close()
    return ids


def rows(engine: Engine) -> list[tuple[str, str | None, int, int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(  # type: ignore[misc]
            "SELECT message_id, k, seq, part FROM public.keyed_effects ORDER BY id")).all()]


def check(engine: Engine, ids: list[str], items: list[tuple[str | None, int]]
          ) -> dict[tuple[str | None, int], list[int]]:
    """Every message's effect once, and each key's effects in the order sent (records
    without a key: in the order of their partition)."""
    found = rows(engine)
    counts: dict[str, int] = defaultdict(int)
    by_key: dict[tuple[str | None, int], list[int]] = defaultdict(list)
    for message_id, key, seq, partition in found:
        counts[message_id] += 1
        by_key[key, partition].append(seq)
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} missing"
    assert max(counts.values()) == 1, "an effect happened twice"
    for key, seqs in by_key.items():
        assert seqs == sorted(seqs), f"key {key!r} out of order: {seqs[:20]}"
    return by_key


@pytest.fixture
def keyed(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    return engine


def app_for(database_url: str, bootstrap: str, topic: str, **overrides: object) -> Consumer:
    values: dict[str, object] = {"mode": "per-message", "concurrency": 64, **overrides}
    app = Consumer(group_id=f"k-{uuid.uuid4().hex[:8]}",
                   settings=settings(database_url, bootstrap, **values))
    app.register(topic, handle)
    return app


def spread(keys: int, per_key: int) -> list[tuple[str | None, int]]:
    """*per_key* messages for each of *keys* keys, interleaved."""
    return [(f"key-{k}", seq) for seq in range(per_key) for k in range(keys)]


class TestPerKeyOrder:
    def test_a_thousand_keys_over_six_partitions_run_together_each_key_in_order(
        self, keyed: Engine, database_url: str, kafka_bootstrap: str,
        kafka_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("TEST_KEYED_SLEEP_MS", "50")
        topic = kafka_topic(partitions=6)
        items = spread(1000, 3)
        ids = produce_keyed(kafka_bootstrap, topic, items)
        app = app_for(database_url, kafka_bootstrap, topic)
        started = time.monotonic()
        with InProcess(app) as running:
            wait_until(lambda: len(rows(keyed)) >= len(items), 120, "3,000 effects")
            took = time.monotonic() - started
            peak = sample(running.runner.metrics, "in_flight")
        check(keyed, ids, items)
        # One at a time, 3,000 waits of 25 ms on average take 75 s; 64 at a time about 1.2 s.
        assert took < 40, f"took {took:.1f} s: handlers did not run at the same time"
        assert peak <= 64

    def test_a_failing_key_holds_up_only_itself_and_its_later_messages_wait_in_order(
        self, keyed: Engine, database_url: str, kafka_bootstrap: str,
        kafka_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("TEST_KEYED_FAILING", "bad")
        topic = kafka_topic(partitions=1)  # every key shares the failing key's partition
        items = [("bad", 0), *spread(50, 4), ("bad", 1)]
        ids = produce_keyed(kafka_bootstrap, topic, items)
        app = app_for(database_url, kafka_bootstrap, topic, concurrency=8, max_attempts=1000)
        with InProcess(app) as running:
            wait_until(lambda: len(rows(keyed)) >= 200, 60, "the other keys' 200 effects")
            metrics = running.runner.metrics
            wait_until(lambda: sample(metrics, "parked_keys", topic=topic, partition="0") == 1,
                       10, "one parked key")
            assert sample(metrics, "parked_partitions") == 1
            # The offset stays below the failing message: a crash would redeliver from it.
            assert running.runner.offsets.pending.get(next(iter(
                running.runner.consumer.assignment()))) in (None, 0)
            assert sample(metrics, "watermark_lag_messages", topic=topic, partition="0") == 202
            monkeypatch.delenv("TEST_KEYED_FAILING")  # the supplier is back
            wait_until(lambda: len(rows(keyed)) == 202, 30, "the failing key's two effects")
        by_key = check(keyed, ids, items)
        assert by_key["bad", 0] == [0, 1]
        with keyed.connect() as conn:
            status = conn.execute(text(
                "SELECT status FROM outboxkit.consumer_failures WHERE consumer_group = :g"
                " AND kafka_offset = 0"), {"g": app.group_id}).scalar_one()
        assert status == "recovered"

    def test_a_message_parked_by_a_stopped_process_is_marked_recovered_by_the_next(
        self, keyed: Engine, database_url: str, kafka_bootstrap: str,
        kafka_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A deploy stops a consumer while a message waits for its retry: the next process
        handles it (the offset stayed below it) and its failure row says ``recovered``,
        however far into the first batch it reads the message."""
        topic = kafka_topic(partitions=1)
        items = [*spread(5, 1), ("bad", 0), *spread(30, 1)]
        ids = produce_keyed(kafka_bootstrap, topic, items)
        monkeypatch.setenv("TEST_KEYED_FAILING", "bad")
        first = app_for(database_url, kafka_bootstrap, topic, concurrency=4, max_attempts=100)
        with InProcess(first):
            wait_until(lambda: len(rows(keyed)) >= 35, 60, "the other keys' effects")
        monkeypatch.delenv("TEST_KEYED_FAILING")
        second = Consumer(group_id=first.group_id, settings=first.settings)
        second.register(topic, handle)
        with InProcess(second):
            wait_until(lambda: len(rows(keyed)) >= 36, 60, "the parked message's effect")
        check(keyed, ids, items)
        with keyed.connect() as conn:
            status = conn.execute(text(
                "SELECT status FROM outboxkit.consumer_failures WHERE consumer_group = :g"),
                {"g": first.group_id}).scalars().all()
        assert status == ["recovered"]

    def test_keyless_records_and_a_key_of_a_megabyte(
        self, keyed: Engine, database_url: str, kafka_bootstrap: str,
        kafka_topic: Callable[..., str],
    ) -> None:
        topic = kafka_topic(partitions=2)
        items: list[tuple[str | None, int]] = [
            *[(None, i) for i in range(40)], *[("big", i) for i in range(3)], *spread(10, 2)]
        # 1 MB, under the broker's message.max.bytes (1 MiB with the record's overhead).
        ids = produce_keyed(kafka_bootstrap, topic, items, big_key=b"k" * 1_000_000)
        app = app_for(database_url, kafka_bootstrap, topic)
        with InProcess(app):
            wait_until(lambda: len(rows(keyed)) >= len(items), 60, "every effect")
        by_key = check(keyed, ids, items)
        keyless = [seqs for (key, _), seqs in by_key.items() if key is None]
        assert sorted(s for seqs in keyless for s in seqs) == list(range(40))
        assert [len(seqs) for (key, _), seqs in by_key.items() if key == "big"] == [3]


# The consumers of these tests: tests/e2e/keyed_app.py, 64 handlers at a time.
APP = "tests.e2e.keyed_app:app"
AT_64 = {"OUTBOXKIT_CONSUMER_MODE": "per-message", "OUTBOXKIT_CONSUMER_CONCURRENCY": "64"}


class TestCrashesAndRebalances:
    def test_sigkill_with_64_in_flight_repeated_loses_nothing_and_repeats_nothing(
        self, keyed: Engine, database_url: str, kafka_bootstrap: str,
        kafka_topic: Callable[..., str], tmp_path: Path,
    ) -> None:
        topic = kafka_topic(partitions=6)
        items = spread(300, 4)
        ids = produce_keyed(kafka_bootstrap, topic, items)
        procs = ConsumerProcesses(database_url, kafka_bootstrap, topic, tmp_path, app=APP)
        env = {**AT_64, "TEST_KEYED_SLEEP_MS": "400"}
        try:
            for _ in range(3):
                before = len(rows(keyed))
                proc = procs.start(**env)
                # Killed while its 64 threads are inside handlers (each waits up to 0.4 s).
                wait_until(lambda b=before: len(rows(keyed)) >= b + 50, 60,
                           "effects from the new process")
                procs.kill(proc)
            final = procs.start(**{**env, "TEST_KEYED_SLEEP_MS": "0"})
            wait_until(lambda: len(rows(keyed)) >= len(items), 90, "every effect")
            time.sleep(1)  # a repeated effect would show up now
            assert final.poll() is None
            check(keyed, ids, items)
        finally:
            procs.stop_all()

    def test_a_consumer_joining_and_leaving_while_64_are_in_flight(
        self, keyed: Engine, database_url: str, kafka_bootstrap: str,
        kafka_topic: Callable[..., str], tmp_path: Path,
    ) -> None:
        topic = kafka_topic(partitions=6)
        items = spread(600, 4)
        ids = produce_keyed(kafka_bootstrap, topic, items)
        procs = ConsumerProcesses(database_url, kafka_bootstrap, topic, tmp_path, app=APP)
        env = {**AT_64, "TEST_KEYED_SLEEP_MS": "800"}  # 64 at a time: about 160 a second
        try:
            procs.start(**env)
            wait_until(lambda: len(rows(keyed)) >= 100, 60, "the first consumer's effects")
            second = procs.start(**env)  # joins: partitions move while handlers run
            wait_for_group(kafka_bootstrap, procs.group_id, 2)
            joined = len(rows(keyed))
            assert joined < len(items) - 300, "the work ended before the second one joined"
            wait_until(lambda: len(rows(keyed)) >= joined + 300, 60, "effects of both")
            assert procs.stop(second) == 0  # leaves with 64 in flight: they move back
            wait_until(lambda: len(rows(keyed)) >= len(items), 90, "every effect")
            time.sleep(1)
            check(keyed, ids, items)
            with keyed.connect() as conn:
                pids = conn.execute(text(
                    "SELECT count(DISTINCT pid) FROM public.keyed_effects")).scalar_one()
            assert pids == 2
        finally:
            procs.stop_all()
