"""Consumer processes killed at the worst moments: every message's effect still happens once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from tests.e2e.conftest import wait_until
from tests.e2e.consumer_support import (
    ConsumerProcesses,
    create_effects,
    effects,
    port,
    produce,
    wait_for_group,
    wait_for_metric,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("kafka_client")]


@pytest.fixture
def consumers_for(
    database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> Iterator[Callable[[str], ConsumerProcesses]]:
    made: list[ConsumerProcesses] = []

    def make(topic: str) -> ConsumerProcesses:
        procs = ConsumerProcesses(database_url, kafka_bootstrap, topic, tmp_path)
        made.append(procs)
        return procs

    try:
        yield make
    finally:
        for procs in made:
            procs.stop_all()


def test_killed_between_database_commit_and_offset_commit_redelivers_and_drops_duplicates(
    engine: Engine,
    kafka_bootstrap: str,
    kafka_topic: Callable[..., str],
    consumers_for: Callable[[str], ConsumerProcesses],
) -> None:
    topic = kafka_topic(partitions=1)
    create_effects(engine)
    ids = produce(kafka_bootstrap, topic, [{"n": i} for i in range(20)])
    procs = consumers_for(topic)

    first = procs.start(OUTBOXKIT_FAILPOINTS="consumer.after_db_commit=kill@1")
    assert first.wait(timeout=90) == -9, procs.logs()
    before = effects(engine)
    assert before, "the first process committed nothing before it was killed"
    assert set(before.values()) == {1}

    metrics_port = port()
    procs.start(http_port=metrics_port)
    dropped = wait_for_metric(
        metrics_port, "outboxkit_consumer_duplicates_total", lambda v: v >= len(before), 90
    )
    wait_until(lambda: len(effects(engine)) == 20, 60, "all 20 effects")
    assert dropped == len(before)  # exactly the committed ones came back, and were dropped
    assert effects(engine) == dict.fromkeys(ids, 1)


def test_two_consumers_in_one_group_one_killed_mid_batch_every_effect_exactly_once(
    engine: Engine,
    kafka_bootstrap: str,
    kafka_topic: Callable[..., str],
    consumers_for: Callable[[str], ConsumerProcesses],
) -> None:
    topic = kafka_topic(partitions=4)
    create_effects(engine)
    total = 1200
    procs = consumers_for(topic)
    # Slow handlers and small batches: the kill lands inside a batch's transaction.
    slow = {"TEST_CONSUMER_HANDLER_SLEEP": "0.004", "OUTBOXKIT_CONSUMER_MAX_POLL_RECORDS": "100"}
    a = procs.start(**slow)
    b = procs.start(**slow)
    # Both in the group before the first record: else the first one up can drain all 1,200
    # before the second joins, and the kill would land on an idle consumer.
    wait_for_group(kafka_bootstrap, procs.group_id, 2)
    ids = produce(kafka_bootstrap, topic, [{"n": i} for i in range(total)])

    def rows_by(pid: int) -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM public.consumer_effects WHERE pid = :p"), {"p": pid}
                ).scalar_one()
            )

    wait_until(lambda: rows_by(a.pid) > 0 and rows_by(b.pid) > 0, 90, "both consumers working")
    wait_until(lambda: len(effects(engine)) > total // 4, 90, "a quarter done")
    procs.kill(a)
    wait_until(lambda: len(effects(engine)) == total, 150, f"all {total} effects")
    assert effects(engine) == dict.fromkeys(ids, 1)
    assert b.poll() is None, procs.logs()


def test_sigterm_finishes_the_batch_commits_offsets_and_exits_0(
    engine: Engine,
    kafka_bootstrap: str,
    kafka_topic: Callable[..., str],
    consumers_for: Callable[[str], ConsumerProcesses],
) -> None:
    topic = kafka_topic(partitions=2)
    create_effects(engine)
    ids = produce(kafka_bootstrap, topic, [{"n": i} for i in range(40)])
    procs = consumers_for(topic)
    first = procs.start()
    wait_until(lambda: len(effects(engine)) == 40, 90, "40 effects")
    assert procs.stop(first) == 0, procs.logs()

    more = produce(kafka_bootstrap, topic, [{"n": i} for i in range(5)])
    metrics_port = port()
    procs.start(http_port=metrics_port)
    wait_for_metric(metrics_port, "outboxkit_consumer_processed_total", lambda v: v >= 5, 90)
    # Offsets were committed on the way out: nothing of the first 40 came back.
    assert (
        wait_for_metric(metrics_port, "outboxkit_consumer_duplicates_total", lambda v: True, 5) == 0
    )
    assert effects(engine) == dict.fromkeys([*ids, *more], 1)


def failure_status(engine: Engine, group: str) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT status FROM outboxkit.consumer_failures WHERE consumer_group = :g"),
            {"g": group}).scalars())


def test_a_parked_message_handled_by_the_next_process_is_marked_recovered(
    engine: Engine,
    kafka_bootstrap: str,
    kafka_topic: Callable[..., str],
    consumers_for: Callable[[str], ConsumerProcesses],
) -> None:
    """The process that parked a message remembers it in memory only: the one that handles
    it after a deploy's SIGTERM (or a crash) must still say 'recovered', or `outbox dlq list
    --status retrying` lists it for ever and retention never purges its operation."""
    topic = kafka_topic(partitions=1)
    create_effects(engine)
    [parked, *rest] = produce(kafka_bootstrap, topic,
                              [{"n": 0, "fail": "later"}, {"n": 1}, {"n": 2}])
    procs = consumers_for(topic)
    first = procs.start(TEST_CONSUMER_RETRY_LATER_S="60")
    wait_until(lambda: failure_status(engine, procs.group_id) == ["retrying"], 60,
               "the first message parked")
    assert procs.stop(first) == 0, procs.logs()
    procs.start()
    wait_until(lambda: len(effects(engine)) == 3, 60, "all 3 handled by the second process")
    assert effects(engine) == dict.fromkeys([parked, *rest], 1)
    wait_until(lambda: failure_status(engine, procs.group_id) == ["recovered"], 10,
               "the failure row marked recovered")
