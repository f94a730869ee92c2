"""The consumer process: poll, process with dedup marks, commit offsets, repeat.

Two threads, one batch apart. The loop's thread owns the Kafka consumer (poll, seek, offset
commits); one handler thread processes the batches, one at a time and in poll order, so
handlers, database commits and offsets keep the order of a single-threaded loop. While the
handler thread waits on PostgreSQL for batch N, the loop parses batch N+1 out of Kafka's
responses (most of a poll's cost): the two overlap instead of adding up. While N is
handled, N+1 waits in the handler thread's queue and the loop polls and decodes N+2; it
polls N+3 only once N is done. The handler thread goes from N to N+1 by itself
(:meth:`Runner._handle_next`): if N failed, N+1 and N+2 are dropped and all are read again
from the first unhandled offset; records of partitions N parked are left out of both, to be
read again. Offsets are sent only for work whose database transaction committed. A message
that failed parks its partition (paused, seeked back to it) until its retry is due; the
other partitions keep flowing (:mod:`consumers.parking`). Background work (dedup retention)
runs as APScheduler jobs whose bodies are plain functions.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine

from consumers.app import Consumer
from consumers.brokers import Brokers
from consumers.concurrent import KeyedLoop, KeyedRebalance
from consumers.deadletter import KafkaSender, Sent
from consumers.decode import Decoding, decode_many
from consumers.metrics import ConsumerMetrics
from consumers.offsets import Attached, OffsetTracker, Rebalance
from consumers.parking import ParkingLot
from consumers.processing import Position, Processor, Progress
from consumers.settings import ConsumerSettings
from consumers.unreadable import SkippedRecord, skip_unreadable
from consumers.watchdog import Verdict, Watchdog
from consumers.window import verify_window
from dedup.inbox import purge_marks
from outbox.backoff import Backoff
from outbox.db.dsn import redact
from outbox.db.engines import engine_for
from outbox.db.migrate import check_schema
from outbox.db.schema import translate
from outbox.errors import ConfigurationError
from outbox.kafka import Consumer as KafkaConsumer
from outbox.kafka import (
    ConsumerOptions,
    RebalanceListener,
    TopicPartition,
    UnreadableRecord,
    describe_client,
)
from outbox.runtime import Lifecycle, required_database_url
from outbox.runtime.failpoints import FailpointTriggered, failpoint

log = logging.getLogger(__name__)

LAG_EVERY_S = 0.5
"""While batches flow, the lag gauges are refreshed this often (every turn when idle)."""


def _freeze_startup_objects() -> None:
    """Keep what start-up made (modules, the clients, the engine) out of the garbage
    collector's full collections from now on.

    A batch's records live until it is handled, long enough to be promoted to the oldest
    generation; a full collection then comes every few tens of thousands of messages and
    walks every object of the process (110,000 after the imports): 2-4 µs of the consumer's
    CPU per message, a quarter of a no-op batch's (issue 34). Frozen objects are not walked
    (0.1-0.6 µs). What they cost instead: one of them that later becomes garbage in a
    reference cycle is never freed (a Kafka client replaced by the watchdog), a few objects
    per rebuild. Collected first, so no garbage is frozen.
    """
    gc.collect()
    gc.freeze()


_Batch = tuple[Future[Progress | None], list[Any], frozenset[Position]]
"""A batch given to the handler thread: its future (None: dropped unhandled), its records,
and which of them are retries of parked messages."""

OWN_PROCESS_SWITCH_INTERVAL_MS = 0.5
"""The thread switch interval of a consumer with kafka-python run as its own process."""


def switch_interval_ms(settings: ConsumerSettings, *, own_process: bool) -> float | None:
    """The thread switch interval the runner sets (None: the interpreter's, left alone).

    Three threads take turns on the interpreter's lock: the loop's (parsing what Kafka sent,
    decoding), the handler thread's (a batch's statements) and the Kafka client's own. When
    the database answers the handler thread, it waits until the thread holding the lock
    lets go: up to the switch interval, 5 ms by default, a third of a 500-message batch's
    time with kafka-python, which parses in the interpreter. With confluent-kafka (parsing
    in librdkafka's threads, without the lock) a shorter interval measured no faster and
    cost 0.6 µs more CPU per message: more switches while both threads compute. Only a
    process of the consumer's own: an embedding program's interpreter is left alone.
    """
    if settings.switch_interval_ms is not None:
        return settings.switch_interval_ms
    if own_process and settings.resolved_kafka_client() == "kafka-python":
        return OWN_PROCESS_SWITCH_INTERVAL_MS
    return None


def _switch_interval(ms: float | None) -> float | None:
    """Set the interpreter's thread switch interval to *ms* (None: leave it); the interval it
    had, in ms, to be put back (None if unchanged)."""
    if ms is None:
        return None
    before = sys.getswitchinterval() * 1000
    sys.setswitchinterval(ms / 1000)
    return before


class Runner:
    """Runs a :class:`Consumer` app. ``run()`` blocks until ``stop()`` (e.g. on SIGTERM)."""

    def __init__(self, app: Consumer, *, own_process: bool = False) -> None:
        """*own_process*: the process runs this consumer and nothing else (``outbox
        consume``): interpreter-wide settings may be tuned for it (:func:`switch_interval_ms`)."""
        self.app = app
        self._own_process = own_process
        self.settings = s = app.settings
        url = required_database_url(s)
        if not app.registrations:
            raise ConfigurationError("the consumer app has no handlers: register one first")
        self._url = url
        keyed = s.mode == "per-message"
        self.engine: Engine = engine_for(
            # Per-message mode: a connection for each handler thread, and the loop's own.
            url, pool_size=s.concurrency + 1 if keyed else 3, max_overflow=2,
            pool_pre_ping=True, answer_timeout_s=s.database_answer_timeout_seconds or None,
        ).execution_options(schema_translate_map=translate(app.outbox_settings))
        self.metrics = ConsumerMetrics()
        self.lifecycle = Lifecycle(
            "consumer",
            app.group_id,
            log=log,
            ready_gauge=self.metrics.ready,
            # At least 0.1 s: a failing batch (its handler thread, its database) is retried
            # as a whole, not in a tight loop, even with backoff_initial_seconds at 0.
            backoff=Backoff(
                base=min(max(0.1, s.backoff_initial_seconds), s.backoff_max_seconds),
                cap=s.backoff_max_seconds,
                jitter=0.5,
            ),
            stuck_after_s=s.max_poll_interval_ms / 1000 + 30,
            # Start-up waits (e.g. for its topic to be created) are not a hang.
            alive_while_starting=True,
        )
        self.offsets = OffsetTracker()
        self.kafka = s.kafka()  # the Kafka client chosen (kafka_client)
        self.sender = KafkaSender(self.kafka, client_id=f"outboxkit-{app.group_id}")
        self._stop = self.lifecycle.stopping
        self.processor = Processor(
            app, self.engine, self.metrics, self._send, stop=self._stop,
            # Per-message mode commits each partition's watermark, not what each commit did.
            committed=self._committed_keyed if keyed else self._committed,
            keep_connection=True,  # released in _shutdown
        )
        self.keyed: KeyedLoop | None = KeyedLoop(self) if keyed else None
        self.consumer: Any = None  # a KafkaConsumer once run() started
        self._handler_thread: ThreadPoolExecutor | None = None
        self.parking = ParkingLot()
        # The batch being handled, and which of its records are retries of parked messages;
        # and the batch queued behind it on the handler thread (see _queue).
        self._in_hand: _Batch | None = None
        self._queued: _Batch | None = None
        self._closing_loop = threading.Event()  # set as the loop ends: queued batches drop
        # The offset each assigned partition's next record has when it follows the last batch
        # (what was read before it is handled, parked, or rewound and read again).
        self._next: dict[tuple[str, int], int] = {}
        session_s = s.session_timeout_ms / 1000
        self.brokers = Brokers(s, app.group_id)
        self.watchdog = Watchdog(
            after_s=s.watchdog_session_timeouts * session_s, check_every_s=session_s / 2,
            group=lambda: self.brokers.group(self.consumer),
            behind=lambda: self.brokers.behind(self.consumer,
                                               self.consumer.assignment() - self._paused))
        self._listener: Attached | None = None
        self._closing: threading.Thread | None = None  # the last client replaced, closing
        self._stall_reported = False
        self._progressed = False  # a batch was handled since the watchdog last looked
        self._stuck: Any = None  # failpoint consumer.stuck_fetch: the client whose polls stall
        self._paused: set[TopicPartition] = set()  # paused by the loop, at its last turn
        self._lag_due = 0.0  # when the loop refreshes the lag gauges next while it works

    # --- probes ---------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.lifecycle.ready()

    def healthy(self) -> bool:
        """Alive: starting up (e.g. waiting for its topic to be created), or looping."""
        return self.lifecycle.healthy()

    # --- lifecycle ------------------------------------------------------------------------
    def stop(self) -> None:
        """Finish the current batch, commit the database then the offsets, and return."""
        self.lifecycle.stop()

    def run(self) -> int:
        s, app = self.settings, self.app
        client = describe_client(self.kafka.name)
        log.info(
            "consumer %s starting (topics %s, database %s, kafka %s with %s, %s mode)",
            app.group_id,
            ", ".join(app.topics),
            redact(self._url),
            s.resolved_bootstrap(),
            client,
            s.mode,
            extra={"event": "consumer.start", "kafka_client": client},
        )
        try:
            # Up before the waits of start-up: healthy (alive) while not yet ready.
            self.lifecycle.serve_http(s.http_host, s.http_port, self.metrics.registry)
            if not verify_window(s, app.topics, self._stop):
                return 0  # stopped while waiting for a topic to be created
            with self.engine.connect() as conn:
                check_schema(conn, settings=app.outbox_settings)
            self.consumer = self._make_consumer()
            self._await_topic_metadata()
            rebalance = (Rebalance(self.offsets, self.metrics) if self.keyed is None
                         else KeyedRebalance(self.keyed, self.offsets, self.metrics))
            self._subscribe(rebalance)
            self._start_scheduler()
            _freeze_startup_objects()
            switched = _switch_interval(switch_interval_ms(s, own_process=self._own_process))
            self.lifecycle.set_ready(True)
            try:
                if self.keyed is None:
                    self._loop()
                else:
                    self.keyed.run()
            finally:
                _switch_interval(switched)
        finally:
            self._shutdown()
        return 0

    def _await_topic_metadata(self, timeout_s: float = 15.0) -> None:
        """Join the group only once the topics' partitions are known.

        A member that joins before the broker has metadata for a new topic is assigned
        nothing, and kafka-python may not rejoin until its next metadata refresh.
        """
        deadline = time.monotonic() + timeout_s
        missing = set(self.app.topics)
        while missing and time.monotonic() < deadline and not self._stop.is_set():
            missing = {t for t in missing if not self.consumer.partitions_for_topic(t)}
            if missing:
                time.sleep(0.1)
        if missing:
            log.warning("no partitions known yet for %s; joining anyway",
                        ", ".join(sorted(missing)), extra={"event": "consumer.topics_unknown"})

    def _make_consumer(self) -> KafkaConsumer:
        s = self.settings
        try:
            return self.kafka.consumer(ConsumerOptions(
                group_id=self.app.group_id,
                client_id=f"outboxkit-{self.app.group_id}",
                auto_offset_reset=s.auto_offset_reset,
                max_poll_records=s.max_poll_records,
                session_timeout_ms=s.session_timeout_ms,
                max_poll_interval_ms=s.max_poll_interval_ms,
                # New topics and partition changes are noticed within seconds, not minutes.
                metadata_max_age_ms=10_000,
            ))
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"the Kafka consumer refused its settings: {exc}") from exc

    def _start_scheduler(self) -> None:
        s = self.settings
        if s.dedup_retention_seconds <= 0:
            return
        sched = self.lifecycle.scheduler()
        sched.add_job(
            self.lifecycle.job(self._retention),
            "interval",
            seconds=s.retention_interval_seconds,
            id="retention",
            next_run_time=datetime.now(UTC),
        )
        sched.start()

    def _retention(self) -> None:
        deleted = purge_marks(
            self.engine,
            self.app.group_id,
            older_than_s=self.settings.dedup_retention_seconds,
            batch=self.settings.retention_batch,
            settings=self.app.outbox_settings,
        )
        self.metrics.purged.inc(deleted)
        if deleted:
            log.info("purged %d dedup marks", deleted, extra={"event": "consumer.retention"})

    def _shutdown(self) -> None:
        self.lifecycle.stop_background()
        self.brokers.close()
        if self.consumer is not None:
            # The database has committed everything processed: now (and only now) the offsets.
            self.offsets.commit(self.consumer)
            self.consumer.close()
        self.sender.close()
        self.processor.release()
        self.engine.dispose()
        self.lifecycle.close()

    # --- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        self._handler_thread = ThreadPoolExecutor(1, thread_name_prefix="outboxkit-handlers")
        self._closing_loop.clear()
        try:
            while not self._stop.is_set():
                self.lifecycle.beat()
                self.parking.wake_due(self.consumer)
                try:
                    records = self.poll(self._poll_timeout_ms())
                except UnreadableRecord as exc:
                    # Skipping marks the record's offset done: only once the batches before
                    # it are (if one failed, all are read again first).
                    if not self._drain():
                        continue
                    skipped = skip_unreadable(self.consumer, self.engine,
                                              group=self.app.group_id, error=exc,
                                              metrics=self.metrics)
                    if skipped is None:
                        self.lifecycle.back_off(f"the Kafka client cannot read a record: {exc}")
                    else:
                        tp, offset = skipped
                        self.offsets.done([SkippedRecord(tp.topic, tp.partition, offset)])
                    continue
                self.parking.sync(self.consumer)  # the poll may have run a rebalance
                assigned = self.consumer.assignment()
                self._forget_revoked(assigned)
                # Fetched before a partition parked earlier was paused: read again later.
                records = self.parking.without_parked(records)
                # Decoded here, while the handler thread handles the batches before: a third
                # of a batch's CPU moved off the handler thread's path.
                decoded = self._decode_ahead(records)
                # Offered to the commit of the batch it follows (Processor.offer), as early
                # as it can be: that commit may come before the batch in hand is collected.
                last = self._queued or self._in_hand
                if records and decoded is not None and last is not None:
                    self.processor.offer(records, decoded, after=last[1])
                behind = [*self._queued[1], *records] if self._queued else records
                if not self._collect(behind):
                    self._queued = None  # it drops itself (_handle_next); all read again
                    self.processor.retract_offer(records)
                    continue
                self._in_hand, self._queued = self._queued, None
                # The batch collected may have parked partitions of this one.
                kept = self.parking.without_parked(records)
                if len(kept) < len(records):
                    self.processor.retract_offer(records)
                    records, decoded = kept, None
                if records:
                    self._queued = self._queue(records, decoded)
                self._end_turn(assigned, polled=bool(records))
        finally:
            # Stopping: what is queued is not started, and the batch in hand finishes (or
            # gives up) first.
            self._closing_loop.set()
            self._drain()
            # Marks inserted ahead for a batch not handled go now, not at the connection's
            # release (after the client left its group, when others may read the messages).
            self._handler_thread.submit(self.processor.withdraw)
            self._handler_thread.shutdown(wait=True)

    def _end_turn(self, assigned: Collection[TopicPartition], *, polled: bool) -> None:
        """A turn's end: offsets sent, the lag gauges and the watchdog."""
        self.offsets.commit_async(self.consumer)
        handled, self._progressed = self._progressed, False
        busy = any(b is not None and not b[0].done() for b in (self._in_hand, self._queued))
        progressed = polled or handled or busy
        # The watchdog reads the lags only on a turn without progress; the gauges are
        # refreshed at least every LAG_EVERY_S (asking the client per partition on every
        # batch cost 0.3 µs per message).
        now = time.monotonic()
        lag: dict[TopicPartition, int] = {}
        if not progressed or now >= self._lag_due:
            self._lag_due = now + LAG_EVERY_S
            lag = self.update_lag(assigned)
        self.watch(assigned, lag, self.parking.partitions(), progressed=progressed)

    def _poll_timeout_ms(self) -> int:
        """The poll's wait, cut short when a parked message is due before it ends."""
        due = self.parking.next_due()
        if due is None:
            return self.settings.poll_timeout_ms
        return max(1, min(self.settings.poll_timeout_ms, int((due - time.monotonic()) * 1000)))

    def _unsure(self, records: Sequence[Any]) -> list[Position]:
        """The first record of each partition that does not follow the last batch read (the
        process started, a rebalance, a rewind): an earlier process may have parked it, and
        only the failures table knows (the processor asks it)."""
        # Each partition's first record (a dict made from the end keeps the first offset)
        # and its last; comprehensions, not a loop with tests: this runs for every record.
        first = {(r.topic, r.partition): r.offset for r in reversed(records)}
        following = self._next
        unsure = [(tp[0], tp[1], offset) for tp, offset in first.items()
                  if following.get(tp) != offset]
        following.update({(r.topic, r.partition): r.offset + 1 for r in records})
        return unsure

    def _forget_revoked(self, assigned: Collection[TopicPartition]) -> None:
        """A partition revoked (and maybe assigned back later) no longer follows anything:
        another process may have parked its next record meanwhile."""
        for tp in [tp for tp in self._next if tp not in assigned]:  # a named tuple: same hash
            del self._next[tp]

    def _queue(
        self, records: list[Any], decoded: Decoding | None
    ) -> _Batch:
        """Queue *records* on the handler thread, behind the batch in hand.

        The handler thread goes on from one batch to the next by itself. Handed over after
        the batch before was collected, the next one waited for the loop's thread to run,
        then for the interpreter's lock (up to the switch interval, 5 ms by default, while
        the loop parses the next poll): a median 3.4 ms between two batches of 11.4 ms with
        confluent-kafka (issue 34; 0.17 ms queued). The batch before may commit with this
        one's marks (offered by the loop): it is handed over as offered.
        """
        assert self._handler_thread is not None
        before = self._in_hand[0] if self._in_hand is not None else None
        retries = self.parking.retries_in(records)
        future = self._handler_thread.submit(
            self._handle_next, before, records, retries, self._unsure(records), decoded)
        return future, records, retries

    def _handle_next(
        self, before: Future[Progress | None] | None, records: list[Any],
        retries: frozenset[Position], unsure: list[Position], decoded: Decoding | None,
    ) -> Progress | None:
        """A queued batch, on the handler thread once *before* (the batch queued ahead of it)
        is done: None when it is dropped, to be read again.

        Dropped when *before* failed or was dropped (the loop rewinds both) or the loop is
        closing. Records of partitions that *before* parked are left out: the loop seeks
        those partitions back to the parked message, so they are read again after it.
        """
        queued = records  # the batch as the offer behind it names it
        self.processor.retract_offer(records)  # an offer not taken by *before*'s commit
        if before is not None:
            progress = None if before.exception() is not None else before.result()
            if progress is None:
                self.processor.withdraw()
                return None
            if progress.parked:
                parked = {(p.topic, p.partition) for p in progress.parked}
                kept = [r for r in records if (r.topic, r.partition) not in parked]
                if len(kept) < len(records):
                    records, decoded = kept, None  # not as offered: process() withdraws
        if self._closing_loop.is_set() or not records:
            self.processor.withdraw()
            return None if self._closing_loop.is_set() else Progress(0)
        return self._handle(records, retries, unsure, decoded, key=queued)

    def _handle(
        self, records: list[Any], retries: frozenset[Position], unsure: list[Position],
        decoded: Decoding | None = None, *, key: object = None,
    ) -> Progress:
        """Process one batch (on the handler thread)."""
        started = time.perf_counter()
        progress = self.processor.process(records, retries, unsure, decoded, key=key)
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return progress

    def _drain(self) -> bool:
        """Wait for the batch in hand and the one queued behind it; False if one failed (then
        both are read again)."""
        queued, self._queued = self._queued, None
        if not self._collect(queued[1] if queued is not None else ()):
            return False
        self._in_hand = queued
        return self._collect(())

    def _collect(self, polled: Sequence[Any]) -> bool:
        """Wait for the batch in hand and park what it parked; False if it failed (then
        *polled*, read behind it, is dropped and both are read again from the first record
        not handled)."""
        if self._in_hand is None:
            return True
        future, records, retries = self._in_hand
        self._in_hand = None
        try:
            progress = future.result()
            if progress is None:
                return True  # dropped unhandled: the loop closing, or the batch before failed
        except Exception as exc:
            self._rewind(self.parking.without_parked([*records, *polled]))
            reason = f"batch failed: {type(exc).__name__}: {exc}"
            self.lifecycle.set_ready(False, reason)
            log.error(
                "processing a batch failed: %s: %s", type(exc).__name__, exc,
                exc_info=exc, extra={"event": "consumer.batch_failed"},
            )
            self.lifecycle.back_off(reason)
            return False
        self._progressed = True
        self.parking.handled(retries)
        for parked in progress.parked:
            self.parking.park(self.consumer, parked)
        self.metrics.parked.set(len(self.parking))
        self.lifecycle.succeeded()
        return True

    def _committed(self, records: Sequence[Any]) -> None:
        failpoint("consumer.after_db_commit")
        self.offsets.done(records)

    def _committed_keyed(self, records: Sequence[Any]) -> None:
        failpoint("consumer.after_db_commit")

    def _rewind(self, records: Sequence[Any]) -> None:
        """After a failure mid-batch, seek each partition back to its first unhandled record."""
        first: dict[TopicPartition, int] = {}
        for record in records:
            tp = TopicPartition(record.topic, record.partition)
            first.setdefault(tp, record.offset)
        assigned = self.consumer.assignment()
        for tp, offset in first.items():
            if tp not in assigned:
                continue  # revoked meanwhile: its next owner reads from the committed offset
            done = self.offsets.pending.get(tp, -1)
            self.consumer.seek(tp, max(offset, done))

    def _send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> Sent:
        return self.sender.send(topic, key=key, value=value, headers=headers)

    def update_lag(self, assigned: Collection[TopicPartition]) -> dict[TopicPartition, int]:
        """Lag per partition: the high watermark minus where this consumer will read next."""
        lags: dict[TopicPartition, int] = {}
        total = 0
        for tp in assigned:
            high = self.consumer.highwater(tp)
            if high is None:
                continue
            position = self.consumer.position(tp)
            if position is None:
                continue  # no position yet (being reset): nothing to report
            lag = lags[tp] = max(0, high - position)
            self.metrics.lag.labels(tp.topic, str(tp.partition)).set(lag)
            total += lag
        self.metrics.lag_total.set(total)
        return lags

    # --- the watchdog (consumers.watchdog) ------------------------------------------------
    def poll(self, timeout_ms: int) -> list[Any]:
        """The client's poll (the loops' only one), and the failpoints that put the client
        in the states the watchdog must notice."""
        try:
            failpoint("consumer.leave_group")
        except FailpointTriggered:
            log.warning("failpoint: the Kafka client leaves its group",
                        extra={"event": "consumer.failpoint"})
            self.consumer.unsubscribe()
        try:
            failpoint("consumer.stuck_fetch")
        except FailpointTriggered:
            log.warning("failpoint: the Kafka client's polls return nothing from now on",
                        extra={"event": "consumer.failpoint"})
            self._stuck = self.consumer
        if self._stuck is not None and self._stuck is self.consumer:
            self._stop.wait(timeout_ms / 1000)
            return []
        records: list[Any] = self.consumer.poll(timeout_ms, self.settings.max_poll_records)
        return records

    def _decode_ahead(self, records: list[Any]) -> Decoding | None:
        """The batch decoded on the loop's thread, or None: the handler's thread decodes it
        then, where any error a model's validator raises (not only a validation error) is
        the batch's failure, rewound and backed off, not the loop's end."""
        if not records:
            return None
        try:
            return decode_many(records, self.app.registrations)
        except Exception as exc:
            log.debug("decoding ahead failed (%s): the batch is decoded with its handling", exc)
            return None

    def watch(self, assigned: Collection[TopicPartition], lags: dict[TopicPartition, int],
              paused: set[TopicPartition], *, progressed: bool) -> None:
        """One turn of the loop seen by the watchdog: a stall makes the consumer not ready
        and, if the brokers answer, rebuilds its client; the end of one makes it ready."""
        if not self.watchdog.enabled:
            return
        self._paused = paused
        waiting = sum(lag for tp, lag in lags.items() if tp not in paused)
        verdict = self.watchdog.observe(assigned=len(assigned), waiting=waiting,
                                        progressed=progressed)
        if verdict.stalled:
            self._stalled(verdict)
        elif verdict.working and self._stall_reported:
            self._stall_reported = False
            log.info("the Kafka client works again", extra={"event": "consumer.unstalled"})
            self.lifecycle.release()

    def _stalled(self, verdict: Verdict) -> None:
        self._stall_reported = True
        self.lifecycle.hold(f"the Kafka client does not work: {verdict.reason}")
        if self._closing is not None and self._closing.is_alive():
            # The client replaced last time is still closing (stuck, maybe still in the
            # group): another would pile up beside it. Not ready, and the liveness probe's
            # or an operator's restart is the way out.
            log.error("the Kafka client does not work (%s), and the one it replaced is still "
                      "closing: not rebuilt again", verdict.reason,
                      extra={"event": "consumer.stalled"})
            self.watchdog.rebuilt()
            return
        silent = self.brokers.answer()
        if silent is not None:
            log.warning("the Kafka client does not work (%s), but the brokers do not answer "
                        "either (%s): not rebuilt", verdict.reason, silent,
                        extra={"event": "consumer.stalled"})
            self.watchdog.rebuilt()  # the next look is a whole delay away
            return
        log.warning("the Kafka client does not work although the brokers answer (%s): "
                    "rebuilding it", verdict.reason, extra={"event": "consumer.stalled"})
        self.rebuild()

    def rebuild(self) -> None:
        """Replace the Kafka client: the partitions are given up as in a revocation, the old
        client is closed in the background (a client stuck on its coordinator may take long
        to close) and a new one joins the group.

        The offsets not yet committed are not asked of the old client: a synchronous commit
        on a client stuck on its coordinator may never return. Their messages (what the
        loop's asynchronous commits had not confirmed) come again, and the dedup marks drop
        them."""
        assert self._listener is not None
        if self.keyed is None:
            self._collect(())  # the batch in hand finishes first
        old, listener = self.consumer, self._listener.inner
        self._listener.detach()  # the old client's callbacks (close()) reach nobody now
        partitions = set(old.assignment()) | set(self.offsets.pending)
        listener.to_commit(partitions)  # per-message mode: the work running ends first
        listener.revoked(partitions, {}, None)
        self.parking.clear()  # the new client has nothing paused to resume
        self._next.clear()
        closing = self._closing = threading.Thread(
            target=old.close, name="outboxkit-old-client", daemon=True)
        closing.start()
        closing.join(timeout=5)
        self.consumer = self._make_consumer()
        self._await_topic_metadata()
        self._subscribe(listener)
        self.metrics.rebuilds.inc()
        self.watchdog.rebuilt()
        # The old client's batch, finished above, is no work of the new one: only the new
        # client's reading ends the stall (and lifts /readyz's hold).
        self._progressed = False
        log.warning("the Kafka client was rebuilt%s", "" if not closing.is_alive()
                    else " (the old one still closing, in the background)",
                    extra={"event": "consumer.rebuilt"})

    def _subscribe(self, listener: RebalanceListener) -> None:
        self._listener = Attached(listener)
        self.consumer.subscribe(self.app.topics, self._listener)
