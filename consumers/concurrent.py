"""Per-message mode: the keys of a partition handled at the same time, each key in order.

The loop's thread owns the Kafka consumer: it polls, queues records in their key's lane
(:mod:`consumers.lanes`), wakes lanes whose retry is due, pauses partitions that hold too
much, and commits each partition's watermark. ``concurrency`` handler threads take lane
heads and handle each in its own transaction (mark, handler, commit;
:meth:`Processor.handle_one`); one key never has two messages running, so a key's effects
commit in offset order. A failure parks the key, not the partition.

Why threads: handlers are plain functions on a plain connection (``ctx.conn``), and they
wait on PostgreSQL and on outside systems with the GIL released; each thread holds a
connection of its own, so a transaction never waits for another one's round trips. The
price, measured: about half the process's CPU at a few thousand messages a second is
thread switches (the GIL changing hands around each round trip); one asyncio loop with
async connections would not pay it, and is the design to try next (with ``async def``
handlers).

Rebalances: before a partition is given up, new work of it stops and the work running is
awaited (at most ``revoke_wait_seconds``); then its watermark is committed. Work still
running after that is abandoned: its transaction may still commit, but its offset is the
next owner's, who reads from the watermark and waits on the dedup mark (the unique index
holds its insert until the first transaction ends), so a key's order holds across owners.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Connection

from consumers import failures
from consumers.lanes import Lanes, Take
from consumers.offsets import Rebalance
from consumers.parking import Parked
from consumers.unreadable import skip_unreadable
from outbox.kafka import TopicPartition, UnreadableRecord

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from consumers.app import Consumer
    from consumers.metrics import ConsumerMetrics
    from consumers.offsets import OffsetTracker
    from consumers.processing import Processor
    from consumers.settings import ConsumerSettings
    from outbox.runtime import Lifecycle


class Host(Protocol):
    """What the loop needs of its :class:`~consumers.runner.Runner`."""

    app: Consumer
    engine: Engine
    consumer: Any
    metrics: ConsumerMetrics
    offsets: OffsetTracker
    processor: Processor
    lifecycle: Lifecycle
    settings: ConsumerSettings

    def update_lag(self, assigned: Collection[TopicPartition]) -> dict[TopicPartition, int]: ...

    def poll(self, timeout_ms: int) -> list[Any]: ...

    def watch(self, assigned: Collection[TopicPartition], lags: dict[TopicPartition, int],
              paused: set[TopicPartition], *, progressed: bool) -> None: ...


class KeyedLoop:
    """The per-message loop of one :class:`~consumers.runner.Runner`."""

    def __init__(self, runner: Host) -> None:
        self.runner = runner
        self.settings = runner.settings
        self.lanes = Lanes()
        self.cond = threading.Condition()  # guards lanes, _recovering, _holding
        self._recovering: set[tuple[str, int, int]] = set()  # left retrying by a process
        self._holding: set[TopicPartition] = set()  # being revoked: nothing new starts
        self._paused: set[TopicPartition] = set()  # loop thread only
        self._threads: list[threading.Thread] = []
        self._failing = 0  # failures not the messages' since the last success (no database)
        self._stopped = False
        self._dropped: dict[TopicPartition, int] = {}  # watermarks of partitions dropped
        self.settled = 0  # messages settled (done or parked), under the lock
        self._seen = 0  # loop thread only: ``settled`` at the last turn

    # --- the loop thread -------------------------------------------------------------------
    def run(self) -> None:
        r, s = self.runner, self.settings
        for i in range(s.concurrency):
            # Daemon: a handler stuck past the shutdown's bound does not keep the process.
            thread = threading.Thread(target=self._work, name=f"outboxkit-handlers_{i}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        try:
            while not r.lifecycle.stopping.is_set():
                r.lifecycle.beat()
                with self.cond:
                    woken = self.lanes.wake(time.monotonic())
                    if woken:
                        self.cond.notify(woken)
                try:
                    records = r.poll(self._poll_timeout_ms())
                except UnreadableRecord as exc:
                    self._skip(exc)
                    continue
                assigned = r.consumer.assignment()
                self._forget_unassigned(assigned)
                records = self._rewind(records, assigned)
                if records:
                    self._add(records)
                self._throttle(assigned)
                with self.cond:
                    watermarks = self.lanes.watermarks()
                    self._gauges(assigned, watermarks)
                    # Work done or going on since the last turn (the watchdog's question).
                    busy = self.settled != self._seen or self.lanes.in_flight > 0
                    self._seen = self.settled
                r.offsets.advance(watermarks)
                r.offsets.commit_async(r.consumer)
                lags = r.update_lag(assigned)
                r.watch(assigned, lags, self._paused, progressed=bool(records) or busy)
        finally:
            self._finish()

    def _poll_timeout_ms(self) -> int:
        with self.cond:
            due = self.lanes.next_due()
        if due is None:
            return self.settings.poll_timeout_ms
        wait = int((due - time.monotonic()) * 1000)
        return max(1, min(self.settings.poll_timeout_ms, wait))

    def _add(self, records: list[Any]) -> None:
        """Queue *records*; partitions read for the first time learn first which of their
        messages an earlier process left parked (handling those marks them recovered)."""
        with self.cond:
            new: dict[TopicPartition, int] = {}
            for rec in records:
                tp = TopicPartition(rec.topic, rec.partition)
                if self.lanes.next_offset(tp) is None:
                    new.setdefault(tp, rec.offset)
        found: set[tuple[str, int, int]] = set()
        if new:
            try:
                with self.runner.engine.connect() as conn:
                    for tp, first in new.items():
                        for offset in failures.retrying_from(
                            conn, group=self.runner.app.group_id, topic=tp.topic,
                            partition=tp.partition, offset=first,
                        ):
                            found.add((tp.topic, tp.partition, offset))
            except Exception as exc:  # no database: read these partitions again later
                for tp, first in new.items():
                    self.runner.consumer.seek(tp, first)
                records = [r for r in records
                           if TopicPartition(r.topic, r.partition) not in new]
                self.runner.lifecycle.set_ready(False, f"database: {exc}")
                self.runner.lifecycle.back_off(
                    f"reading the failures of new partitions failed: {type(exc).__name__}: "
                    f"{exc}")
        with self.cond:
            self._recovering |= found
            self.lanes.add(records)
            self.cond.notify(len(records))

    def _rewind(self, records: list[Any], assigned: Collection[TopicPartition]) -> list[Any]:
        """*records* less those of partitions sought back by :meth:`_seek_dropped`."""
        back = self._seek_dropped(assigned)
        if not back:
            return records
        return [rec for rec in records if TopicPartition(rec.topic, rec.partition) not in back]

    def _seek_dropped(self, assigned: Collection[TopicPartition]) -> set[TopicPartition]:
        """A partition revoked and assigned back is read again from its watermark: its
        lanes were dropped with the records they held, but a client may keep the
        partition's position across the rebalance (kafka-python does), after them. The
        partitions sought back."""
        if not self._dropped:
            return set()
        with self.cond:
            dropped, self._dropped = self._dropped, {}
        back = set()
        for tp, mark in dropped.items():
            if tp not in assigned:
                continue  # gone: its next reader starts from the committed offset
            position = self.runner.consumer.position(tp)
            if position is not None and position > mark:
                self.runner.consumer.seek(tp, mark)
                back.add(tp)
        return back

    def _throttle(self, assigned: Collection[TopicPartition]) -> None:
        """Pause a partition holding ``max_held_per_partition`` records or
        ``max_parked_keys`` parked keys; resume it below half of both."""
        s, consumer = self.settings, self.runner.consumer
        with self.cond:
            state = {tp: (self.lanes.held(tp), self.lanes.parked_lanes(tp),
                          self.lanes.next_offset(tp)) for tp in assigned}
        for tp, (held, parked, next_offset) in state.items():
            full = held >= s.max_held_per_partition or parked >= s.max_parked_keys
            if full and tp not in self._paused:
                consumer.pause(tp)
                if next_offset is not None:
                    consumer.seek(tp, next_offset)  # drop what was fetched after it
                self._paused.add(tp)
            elif (tp in self._paused and held < s.max_held_per_partition // 2 + 1
                  and parked < s.max_parked_keys // 2 + 1):
                consumer.resume(tp)
                self._paused.discard(tp)
        # A partition paused elsewhere (the unreadable-record probe resumes every one; the
        # client keeps a pause across a reassignment) agrees with the loop again.
        paused = consumer.paused()
        stray = [tp for tp in paused if tp not in self._paused]
        if stray:
            consumer.resume(*stray)
        for tp in self._paused - paused:
            consumer.pause(tp)

    def _forget_unassigned(self, assigned: Collection[TopicPartition]) -> None:
        gone = [tp for tp in self.lanes.partitions() if tp not in assigned]
        if gone:
            self.drop(gone)
        self._paused &= set(assigned)

    def _skip(self, exc: UnreadableRecord) -> None:
        r = self.runner
        # The poll that raised may have run a rebalance: partitions dropped and assigned
        # back are read again from their watermark first (the bad record is met again).
        assigned = r.consumer.assignment()
        self._forget_unassigned(assigned)
        if self._seek_dropped(assigned):
            return  # read again from there first; the bad record raises again when reached
        skipped = skip_unreadable(r.consumer, r.engine, group=r.app.group_id, error=exc,
                                  metrics=r.metrics)
        if skipped is None:
            r.lifecycle.back_off(f"the Kafka client cannot read a record: {exc}")
            return
        with self.cond:
            # A partition not read yet starts at the bad record: the client's position
            # (the committed offset) was there.
            self.lanes.skip(*skipped)

    def _gauges(self, assigned: Collection[TopicPartition],
                watermarks: Mapping[TopicPartition, int]) -> None:
        """(Under the lock.) The per-message gauges, from the watermarks just read."""
        m = self.runner.metrics
        m.in_flight.set(self.lanes.in_flight)
        parked = 0
        for tp in assigned:
            keys = self.lanes.parked_lanes(tp)
            parked += keys > 0
            labels = (tp.topic, str(tp.partition))
            m.parked_keys.labels(*labels).set(keys)
            next_offset, mark = self.lanes.next_offset(tp), watermarks.get(tp)
            m.watermark_lag.labels(*labels).set(
                0 if next_offset is None or mark is None else next_offset - mark)
        m.parked.set(parked)

    def _finish(self) -> None:
        """Stopping: nothing new starts; the work running ends (bounded), its watermarks
        are what the runner's shutdown commits."""
        with self.cond:
            self._holding |= set(self.lanes.partitions())
            self.cond.notify_all()
        deadline = time.monotonic() + self.settings.shutdown_timeout_seconds
        with self.cond:
            while self.lanes.in_flight and time.monotonic() < deadline:
                self.cond.wait(0.1)
            watermarks = self.lanes.watermarks()
            self._stopped = True
            self.cond.notify_all()
        self.runner.offsets.advance(watermarks)
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # --- rebalances (the client's thread) --------------------------------------------------
    @property
    def revoke_wait_s(self) -> float:
        """``revoke_wait_seconds``, at most half the session timeout: the client may run the
        revocation where it also sends heartbeats, and must not be presumed dead meanwhile."""
        s = self.settings
        return min(s.revoke_wait_seconds, s.session_timeout_ms / 2000)

    def quiesce(self, partitions: Collection[TopicPartition]) -> None:
        """Before *partitions* are given up: start nothing new of theirs, await what runs
        (at most ``revoke_wait_seconds``), and hand their watermarks to the offsets."""
        chosen = set(partitions)
        deadline = time.monotonic() + self.revoke_wait_s
        with self.cond:
            self._holding |= chosen
            while self.lanes.busy_in(chosen) and time.monotonic() < deadline:
                self.cond.wait(0.05)
            running = self.lanes.busy_in(chosen)
            watermarks = {tp: w for tp, w in self.lanes.watermarks().items() if tp in chosen}
        if running:
            log.warning("%d message(s) of revoked partitions still running after %.1f s: "
                        "left to the next owner (their dedup marks decide)", running,
                        self.revoke_wait_s, extra={"event": "consumer.revoke_abandoned"})
        self.runner.offsets.advance(watermarks)

    def drop(self, partitions: Collection[TopicPartition]) -> None:
        with self.cond:
            for tp in partitions:
                mark = self.lanes.watermark(tp)
                if mark is not None:
                    self._dropped[tp] = mark
            self.lanes.drop(partitions)
            self._holding -= set(partitions)
            self._recovering = {p for p in self._recovering
                                if TopicPartition(p[0], p[1]) not in partitions}
            self.cond.notify_all()

    # --- handler threads -------------------------------------------------------------------

    def _next(self, done: Take | None, again: Parked | None) -> tuple[Take, bool] | None:
        """Settle *done* (finished, or parked until *again*), then wait for the next lane
        head: (it, whether it is a retry). One lock round per message: each wake-up of a
        thread costs a context switch, which at thousands of messages a second is most of
        a message's CPU, so the loop wakes as many threads as it has new work for, and a
        thread that settles a message takes the next one itself."""
        with self.cond:
            if done is not None:
                self._settle(done, again)
            while not (self._stopped or self.runner.lifecycle.stopping.is_set()):
                taken = self.lanes.take(1, skip=self._holding)
                if taken:
                    take = taken[0]
                    record = take.record
                    where = (record.topic, record.partition, record.offset)
                    return take, take.retry or where in self._recovering
                self.cond.wait(0.5)
            return None

    def _settle(self, take: Take, again: Parked | None) -> None:
        """(Under the lock.) A message is done for good, or its key waits for a retry."""
        record = take.record
        self.settled += 1
        if again is None:
            if self._recovering:
                self._recovering.discard((record.topic, record.partition, record.offset))
            self.lanes.finished(take)
        else:
            self.lanes.park(take, again.due)
        if self._holding:
            self.cond.notify_all()  # a revocation or the shutdown awaits running work

    def _work(self) -> None:
        conn: Connection | None = None  # this thread's own, kept between messages
        done: Take | None = None
        again: Parked | None = None
        failed = 0  # this thread's failures in a row that were not the message's
        try:
            while (got := self._next(done, again)) is not None:
                take, recovering = got
                try:
                    if conn is None:
                        conn = self.runner.engine.connect()
                    again = self._handle(take, recovering, conn)
                except Exception as exc:  # the database (or the dead-letter producer) failed
                    if conn is not None:
                        conn.close()  # maybe broken: the next message gets a fresh one
                        conn = None
                    failed += 1
                    self._infrastructure(take, exc, failed)
                    done = None
                    continue
                done, failed = take, 0
                if self._failing:
                    with self.cond:
                        if self._failing:
                            self._failing = 0
                            self.runner.lifecycle.succeeded()
        finally:
            if conn is not None:
                conn.close()

    def _handle(self, take: Take, recovering: bool, conn: Connection) -> Parked | None:
        """Handle one lane head on this thread's connection: when to retry it, if it
        failed (the failure counted on the same connection)."""
        processor, record = self.runner.processor, take.record
        error = processor.handle_one(record, recovering=recovering, conn=conn)
        return None if error is None else processor.retries.settle(record, error, conn=conn)

    def _infrastructure(self, take: Take, exc: BaseException, failed: int) -> None:
        """Not the message's fault: its key waits the runner's backoff, longer after each
        such failure in a row of this thread (no attempt counted)."""
        r, record = self.runner, take.record
        reason = f"handling a message failed: {type(exc).__name__}: {exc}"
        delay = r.lifecycle.backoff.delay(failed)
        with self.cond:
            self._failing += 1
            self.lanes.park(take, time.monotonic() + delay, retry=False)
            r.lifecycle.set_ready(False, reason)  # under the lock: a success resets both
            if self._holding:
                self.cond.notify_all()
        log.error("%s (%s[%d]@%d; its key waits %.1f s)", reason, record.topic,
                  record.partition, record.offset, delay, exc_info=exc,
                  extra={"event": "consumer.batch_failed"})


class KeyedRebalance(Rebalance):
    """A rebalance in per-message mode: revoked partitions finish their running work
    before their watermark is committed; lost ones are dropped at once."""

    def __init__(self, loop: KeyedLoop, *args: Any) -> None:
        super().__init__(*args)
        self.loop = loop

    def to_commit(self, revoked: Collection[TopicPartition]) -> Mapping[TopicPartition, int]:
        self.loop.quiesce(revoked)
        return super().to_commit(revoked)

    def revoked(self, partitions: Collection[TopicPartition],
                committed: Mapping[TopicPartition, int], error: BaseException | None) -> None:
        super().revoked(partitions, committed, error)
        self.loop.drop(partitions)

    def lost(self, partitions: Collection[TopicPartition]) -> None:
        super().lost(partitions)
        self.loop.drop(partitions)
