"""Per-key lanes inside partitions: what may run now, and which offset is safe to commit.

Per-message mode handles messages of different keys at the same time and messages of one
key strictly in offset order. Every record read is queued in its key's lane (a partition's
records without a key share one lane: among themselves they keep offset order). A lane
runs one message at a time: its head. A failing head *parks its lane* until its retry is
due; the other lanes of the partition flow past it.

Kafka keeps one offset per partition, so the offset committed is the partition's
*watermark*: the lowest offset read and not yet done (or the offset after the last record
read, when every one is done). A crash redelivers what is above the watermark; the dedup
marks drop the part that was done.

The lanes are pure bookkeeping (no Kafka, no database, no threads); the loop
(:mod:`consumers.concurrent`) serialises calls with one lock. Memory: a lane exists while
it holds a record; a partition holds what was read and is not done, which the loop bounds
by pausing the partition (:meth:`Lanes.full`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox.kafka import TopicPartition

LaneKey = tuple[TopicPartition, bytes | None]


@dataclass
class _Partition:
    """One partition's records read and not done, in offset order."""

    next_offset: int  # the offset after the last record read
    waiting: deque[int] = field(default_factory=deque)  # offsets read, ascending
    done: set[int] = field(default_factory=set)  # done offsets not yet at the front
    parked: int = 0  # lanes of this partition waiting for a retry

    def watermark(self) -> int:
        return self.waiting[0] if self.waiting else self.next_offset

    def finish(self, offset: int) -> None:
        self.done.add(offset)
        while self.waiting and self.waiting[0] in self.done:
            self.done.discard(self.waiting.popleft())

    @property
    def held(self) -> int:
        """Records read and not yet done."""
        return len(self.waiting) - len(self.done)


@dataclass
class _Lane:
    records: deque[Any] = field(default_factory=deque)
    busy: bool = False
    due: float | None = None  # parked until (monotonic seconds)
    retry: bool = False  # its head failed before: the next try is a retry


@dataclass(frozen=True, eq=False)
class Take:
    """A record handed out to run: *retry* when it failed before (in this process). Its
    outcome is settled with it, in the lane it was taken from: a partition dropped and read
    again meanwhile has new lanes, which a late outcome of the old one must not touch."""

    record: Any
    retry: bool
    lane: _Lane


class Lanes:
    """The lanes of the partitions assigned to one consumer process."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._lanes: dict[LaneKey, _Lane] = {}
        self._ready: deque[LaneKey] = deque()  # lanes whose head may run (not busy, not parked)
        self._due: list[tuple[float, int, LaneKey]] = []  # parked lanes by due time
        self._seq = 0  # ties in _due
        self.in_flight = 0

    # --- reading ---------------------------------------------------------------------------
    def add(self, records: Iterable[Any]) -> list[tuple[TopicPartition, int]]:
        """Queue *records* in their lanes. Records already read (offset below the partition's
        next offset: a fetch the client repeated) are ignored.

        Returns the partitions that start here (first read since assigned): (partition,
        first offset); what an earlier process left parked there is only in the database.
        """
        started: list[tuple[TopicPartition, int]] = []
        for record in records:
            tp = TopicPartition(record.topic, record.partition)
            part = self._partitions.get(tp)
            if part is None:
                part = self._partitions[tp] = _Partition(next_offset=record.offset)
                started.append((tp, record.offset))
            elif record.offset < part.next_offset:
                continue
            part.next_offset = record.offset + 1
            part.waiting.append(record.offset)
            key: LaneKey = (tp, record.key)
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane()
            lane.records.append(record)
            if len(lane.records) == 1 and not lane.busy and lane.due is None:
                self._ready.append(key)
        return started

    def take(self, limit: int, skip: Collection[TopicPartition] = ()) -> list[Take]:
        """Up to *limit* lane heads that may run now, each lane marked busy; none of the
        partitions in *skip* (being given up: their lanes are dropped next)."""
        out: list[Take] = []
        while self._ready and len(out) < limit:
            key = self._ready.popleft()
            lane = self._lanes.get(key)
            if lane is None or lane.busy or lane.due is not None or not lane.records:
                continue  # dropped or changed since queued
            if key[0] in skip:
                continue
            lane.busy = True
            self.in_flight += 1
            out.append(Take(lane.records[0], lane.retry, lane))
        return out

    # --- outcomes --------------------------------------------------------------------------
    def finished(self, take: Take) -> bool:
        """*take*'s record is done for good (handled, a duplicate, skipped, dead-lettered):
        its lane moves on. False when its partition was dropped meanwhile (revoked)."""
        key, lane = self._lane_of(take)
        if lane is None:
            return False
        record = take.record
        self._settle(lane)
        lane.records.popleft()
        lane.retry = False
        self._partitions[key[0]].finish(record.offset)
        if lane.records:
            self._ready.append(key)
        else:
            del self._lanes[key]
        return True

    def park(self, take: Take, due: float, *, retry: bool = True) -> bool:
        """*take*'s record failed: its lane waits until *due*, then runs it again (as a
        retry, unless *retry* is False: the failure was not the message's, e.g. no
        database)."""
        key, lane = self._lane_of(take)
        if lane is None:
            return False
        self._settle(lane)
        lane.due, lane.retry = due, lane.retry or retry
        self._partitions[key[0]].parked += 1
        self._seq += 1
        heapq.heappush(self._due, (due, self._seq, key))
        return True

    def wake(self, now: float) -> int:
        """Parked lanes whose retry is due become ready; how many."""
        woken = 0
        while self._due and self._due[0][0] <= now:
            due, _, key = heapq.heappop(self._due)
            lane = self._lanes.get(key)
            if lane is None or lane.due != due:
                continue  # dropped, or parked again since
            lane.due = None
            self._partitions[key[0]].parked -= 1
            self._ready.append(key)
            woken += 1
        return woken

    def next_due(self) -> float | None:
        """When the earliest parked lane is due, if any."""
        while self._due:
            due, _, key = self._due[0]
            lane = self._lanes.get(key)
            if lane is not None and lane.due == due:
                return due
            heapq.heappop(self._due)
        return None

    def skip(self, tp: TopicPartition, offset: int) -> None:
        """The record at *offset* was read past without a lane (the client could not parse
        it; it is recorded elsewhere): done."""
        part = self._partitions.get(tp)
        if part is None:
            self._partitions[tp] = _Partition(next_offset=offset + 1)
            return
        if offset >= part.next_offset:
            part.next_offset = offset + 1
            part.waiting.append(offset)
            part.finish(offset)

    # --- partitions ------------------------------------------------------------------------
    def watermark(self, tp: TopicPartition) -> int | None:
        """The offset to commit for *tp*: everything below it is done. None: nothing read."""
        part = self._partitions.get(tp)
        return None if part is None else part.watermark()

    def watermarks(self) -> dict[TopicPartition, int]:
        return {tp: part.watermark() for tp, part in self._partitions.items()}

    def next_offset(self, tp: TopicPartition) -> int | None:
        part = self._partitions.get(tp)
        return None if part is None else part.next_offset

    def held(self, tp: TopicPartition) -> int:
        """Records of *tp* read and not done (queued, running or parked)."""
        part = self._partitions.get(tp)
        return 0 if part is None else part.held

    def parked_lanes(self, tp: TopicPartition | None = None) -> int:
        if tp is None:
            return sum(p.parked for p in self._partitions.values())
        part = self._partitions.get(tp)
        return 0 if part is None else part.parked

    def busy_in(self, partitions: Iterable[TopicPartition]) -> int:
        """Records of *partitions* running now."""
        chosen = set(partitions)
        return sum(1 for (tp, _), lane in self._lanes.items() if lane.busy and tp in chosen)

    def drop(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget *partitions* (revoked or lost): their records, lanes and watermarks. A
        record of theirs still running is ignored when it finishes."""
        chosen = set(partitions)
        for tp in chosen:
            self._partitions.pop(tp, None)
        for key in [k for k in self._lanes if k[0] in chosen]:
            lane = self._lanes.pop(key)
            if lane.busy:
                self.in_flight -= 1

    def partitions(self) -> Sequence[TopicPartition]:
        return list(self._partitions)

    # --- helpers ---------------------------------------------------------------------------
    def _lane_of(self, take: Take) -> tuple[LaneKey, _Lane | None]:
        """*take*'s lane, if it is still there and still running *take*."""
        record = take.record
        key: LaneKey = (TopicPartition(record.topic, record.partition), record.key)
        lane = self._lanes.get(key)
        if lane is not take.lane or not lane.busy or lane.records[0] is not record:
            return key, None
        return key, lane

    def _settle(self, lane: _Lane) -> None:
        if lane.busy:
            lane.busy = False
            self.in_flight -= 1
