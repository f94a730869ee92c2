"""Per-key lanes: what may run at once, and the offset a partition may commit."""

from __future__ import annotations

import random
from typing import NamedTuple

from consumers.lanes import Lanes
from outbox.kafka import TopicPartition

P0 = TopicPartition("t", 0)


class R(NamedTuple):
    topic: str
    partition: int
    offset: int
    key: bytes | None


def recs(*keys: bytes | None, partition: int = 0, start: int = 0) -> list[R]:
    return [R("t", partition, start + i, k) for i, k in enumerate(keys)]


def offsets(takes: list) -> list[int]:  # type: ignore[type-arg]
    return [t.record.offset for t in takes]


def test_different_keys_run_together_and_one_key_one_at_a_time() -> None:
    lanes = Lanes()
    lanes.add(recs(b"a", b"b", b"a", b"c", b"b"))
    first = lanes.take(10)
    assert offsets(first) == [0, 1, 3]  # the heads of a, b, c; a's and b's seconds wait
    assert lanes.take(10) == []
    assert lanes.in_flight == 3
    lanes.finished(first[0])  # a@0 done: a@2 may run
    assert offsets(lanes.take(10)) == [2]


def test_the_watermark_stays_at_the_lowest_offset_not_done() -> None:
    lanes = Lanes()
    lanes.add(recs(b"a", b"b", b"c"))
    a, b, c = lanes.take(3)
    assert lanes.watermark(P0) == 0
    lanes.finished(c)
    lanes.finished(b)
    assert lanes.watermark(P0) == 0  # offset 0 still running: nothing may be committed
    lanes.finished(a)
    assert lanes.watermark(P0) == 3  # all done: the offset after the last read


def test_a_parked_key_holds_up_only_itself_and_the_watermark() -> None:
    lanes = Lanes()
    lanes.add(recs(b"bad", b"ok", b"bad", b"ok"))
    bad, ok = lanes.take(10)
    assert lanes.park(bad, due=100.0)
    lanes.finished(ok)
    (ok2,) = lanes.take(10)  # the other key flows past the parked one
    assert ok2.record.offset == 3
    lanes.finished(ok2)
    assert lanes.watermark(P0) == 0  # below the parked message
    assert lanes.parked_lanes(P0) == 1
    assert lanes.wake(now=99.0) == 0
    assert lanes.next_due() == 100.0
    assert lanes.wake(now=100.0) == 1
    (retry,) = lanes.take(10)
    assert (retry.record.offset, retry.retry) == (0, True)
    lanes.finished(retry)
    (after,) = lanes.take(10)
    assert (after.record.offset, after.retry) == (2, False)  # the key's next, in order
    lanes.finished(after)
    assert lanes.watermark(P0) == 4
    assert lanes.parked_lanes(P0) == 0


def test_a_failure_that_is_not_the_message_keeps_its_retry_flag() -> None:
    lanes = Lanes()
    lanes.add(recs(b"a"))
    (a,) = lanes.take(1)
    lanes.park(a, due=1.0, retry=False)
    lanes.wake(2.0)
    (again,) = lanes.take(1)
    assert again.retry is False


def test_records_without_a_key_keep_offset_order_among_themselves() -> None:
    lanes = Lanes()
    lanes.add(recs(None, b"k", None))
    assert offsets(lanes.take(10)) == [0, 1]  # the second keyless record waits for the first


def test_the_same_key_in_two_partitions_is_two_lanes() -> None:
    lanes = Lanes()
    lanes.add([*recs(b"a"), *recs(b"a", partition=1)])
    assert len(lanes.take(10)) == 2


def test_a_repeated_fetch_is_ignored_and_a_new_partition_is_reported() -> None:
    lanes = Lanes()
    assert lanes.add(recs(b"a", b"b", start=5)) == [(P0, 5)]
    assert lanes.add(recs(b"a", b"b", start=5)) == []  # read again (a client's re-fetch)
    assert lanes.held(P0) == 2
    assert lanes.next_offset(P0) == 7


def test_a_dropped_partition_forgets_its_lanes_and_ignores_late_outcomes() -> None:
    lanes = Lanes()
    lanes.add([*recs(b"a", b"b"), *recs(b"c", partition=1)])
    taken = lanes.take(10)
    assert lanes.busy_in([P0]) == 2
    lanes.drop([P0])
    assert lanes.in_flight == 1
    assert lanes.watermark(P0) is None
    assert not lanes.finished(taken[0])
    assert not lanes.park(taken[1], due=0.0)
    assert lanes.watermarks() == {TopicPartition("t", 1): 0}


def test_skip_holds_the_partition_until_its_earlier_records_are_done() -> None:
    lanes = Lanes()
    lanes.add(recs(b"a"))
    lanes.skip(P0, 1)  # unreadable record at offset 1
    assert lanes.watermark(P0) == 0
    lanes.finished(lanes.take(1)[0])
    assert lanes.watermark(P0) == 2
    fresh = Lanes()
    fresh.skip(P0, 9)
    assert fresh.watermark(P0) == 10


def test_skip_keeps_taking_other_partitions() -> None:
    lanes = Lanes()
    lanes.add([*recs(b"a"), *recs(b"b", partition=1)])
    (taken,) = lanes.take(10, skip={P0})
    assert taken.record.partition == 1


def test_a_random_schedule_keeps_every_key_in_offset_order() -> None:
    """Whatever finishes or fails when, each key's records run in offset order, one at a
    time, and the watermark never passes a record not done."""
    rng = random.Random(7)
    lanes = Lanes()
    keys = [str(i).encode() for i in range(40)] + [None]
    records = [R("t", rng.randrange(3), 0, rng.choice(keys)) for _ in range(2000)]
    by_partition: dict[int, int] = {}
    numbered = []
    for r in records:
        offset = by_partition.get(r.partition, 0)
        by_partition[r.partition] = offset + 1
        numbered.append(r._replace(offset=offset))
    lanes.add(numbered[:1000])
    added = 1000
    running: list = []  # type: ignore[type-arg]
    done: list[R] = []
    now = 0.0
    while len(done) < len(numbered):
        now += 1
        lanes.wake(now)
        running += lanes.take(rng.randrange(1, 8))
        keys_running = [(t.record.partition, t.record.key) for t in running]
        assert len(keys_running) == len(set(keys_running))  # one per key at a time
        rng.shuffle(running)
        for take in running[: rng.randrange(len(running) + 1)]:
            running.remove(take)
            if rng.random() < 0.1:
                lanes.park(take, due=now + rng.randrange(5))
            else:
                lanes.finished(take)
                done.append(take.record)
        finished = {(r.partition, r.offset) for r in done}
        for tp, mark in lanes.watermarks().items():
            assert all(r.offset >= mark for r in numbered[:added]
                       if r.partition == tp.partition and (r.partition, r.offset) not in finished)
        if added < len(numbered) and rng.random() < 0.2:
            lanes.add(numbered[added : added + 100])
            added += 100
    for key in keys:
        for p in range(3):
            seen = [r.offset for r in done if r.key == key and r.partition == p]
            sent = {r.offset for r in numbered if r.key == key and r.partition == p}
            assert len(seen) == len(sent)
            assert seen == sorted(seen)
    assert lanes.in_flight == 0
    assert lanes.watermarks() == {TopicPartition("t", p): by_partition[p] for p in range(3)}


def test_a_late_outcome_from_a_dropped_partition_does_not_touch_its_new_lanes() -> None:
    """Work of a revoked partition may still be running when the partition is assigned back
    and its records read again: its outcome must not move the new lane on."""
    lanes = Lanes()
    lanes.add(recs(b"k", b"k"))
    (old,) = lanes.take(10)
    lanes.drop([P0])
    lanes.add(recs(b"k", b"k"))  # assigned back, read again from the watermark
    (new,) = lanes.take(10)
    assert new.record.offset == old.record.offset == 0
    assert not lanes.finished(old)
    assert not lanes.park(old, due=0.0)
    assert lanes.take(10) == []  # k@1 waits for the new k@0, still running
    assert lanes.in_flight == 1
    assert lanes.finished(new)
    assert [t.record.offset for t in lanes.take(10)] == [1]
