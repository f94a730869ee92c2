"""The relay daemon: read a batch of owned lanes, send it, wait for the acks, record it.

The loop is single-threaded on purpose: one batch in flight at a time keeps the order of
each lane obvious. Background work (lane heartbeats, the fallback poll, sweeping dead
relays, retention, metrics) runs as APScheduler jobs whose bodies are plain functions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import psycopg
from apscheduler.schedulers.background import BackgroundScheduler

from outbox.backoff import Backoff
from outbox.db.dsn import libpq_url, redact
from outbox.db.pool import Connection, Pool, one
from outbox.db.queries import driver_sql
from outbox.errors import ConfigurationError
from outbox.kafka import KafkaClientError, describe_client
from outbox.runtime import Lifecycle, required_database_url
from outbox.runtime.failpoints import failpoint
from outbox.settings import OutboxSettings
from relay.claims import (
    CLAIM_PLANNER,
    Claimed,
    Failed,
    OutboxRow,
    Published,
    claim_messages,
    note_error,
    record,
)
from relay.cursors import Cursor
from relay.grouped import Held
from relay.lanes import LaneManager, OwnedLanes
from relay.metrics import RelayMetrics, read_backlog
from relay.publisher import Publisher, describe_briefly
from relay.readahead import ReadAhead
from relay.retention import purge_published
from relay.segments import overtaken, record_bytes, segments, suspect
from relay.settings import RelaySettings
from relay.wakeup import Listener, WakeUp

log = logging.getLogger(__name__)

# The relay's role may not read it (least privilege), or the schema predates it.
OPERATIONS_UNREADABLE = frozenset({"42501", "42P01"})  # insufficient privilege, no such table

# A batch's outcome: (published, refused, set aside, each lane's new cursor and rows passed).
Outcome = tuple[list[Published], list[Failed], list[OutboxRow], dict[int, tuple[Cursor, int]]]

# A batch of at most this many rows is light traffic: the next wake-up while idle lingers.
SPARSE_BATCH = 2

# A batch whose acknowledgements take longer than this makes the relay not ready (and counts
# as one transient Kafka error): the broker is stopped, unreachable or not answering.
SLOW_ACKS_SECONDS = 5.0
# A pooled connection idle this long is tested before use (outbox.db.pool).
PING_AFTER_IDLE_S = 1.0


def error_source(exc: BaseException) -> str | None:
    """Which side a transient error came from (a label value), or None for anything else."""
    if isinstance(exc, psycopg.Error):
        return "postgres"
    if isinstance(exc, KafkaClientError):
        return "kafka"
    return None


def refused_privilege(exc: psycopg.Error) -> None:
    """A privilege the relay's role lacks never comes by waiting: say which, and stop."""
    if exc.sqlstate == "42501":
        raise ConfigurationError(
            f"the relay's role may not do what a claim needs ({describe_briefly(exc)}): "
            "grant it what relay.roles.relay_grants prints (docs/relay.md, 'Least "
            "privilege'), or run `outbox migrate` as the schema's owner if it is behind"
        ) from exc


class Relay:
    """One relay process. ``run()`` blocks until ``stop()`` (e.g. from a signal handler)."""

    def __init__(
        self, settings: RelaySettings, outbox_settings: OutboxSettings | None = None
    ) -> None:
        self.settings = settings
        self.outbox = outbox_settings or OutboxSettings()
        self._url = required_database_url(settings)
        self.schema = self.outbox.schema_name
        # The heartbeat, refusals' records, the gauges and retention. Two pools of their own
        # besides: a claim's connection carries the planner settings its plan needs (see
        # claims), and a clean batch's record is one statement on a connection that is never
        # inside a transaction. Two each: the read-ahead thread claims beside the loop, and
        # the marking thread records beside it (outbox/db/pool.py: all in autocommit).
        self.pool = self._pool(size=3)
        self.claim_pool = self._pool(size=2, connect={"options": CLAIM_PLANNER})
        self.record_pool = self._pool(size=2)
        self.metrics = RelayMetrics()
        # Capped from the first delay: an initial delay over the maximum waits the maximum.
        self.backoff = Backoff(
            base=min(settings.backoff_initial_seconds, settings.backoff_max_seconds),
            cap=settings.backoff_max_seconds,
            jitter=0.5,
        )
        self.lifecycle = Lifecycle(
            "relay",
            settings.relay_id,
            log=log,
            ready_gauge=self.metrics.ready,
            backoff=self.backoff,
            # A loop stuck longer than one delivery timeout plus slack is not alive.
            stuck_after_s=settings.delivery_timeout_ms / 1000 + 60,
        )
        self.lanes = LaneManager(
            self.pool,
            schema=self.schema,
            relay_id=settings.relay_id,
            lanes=self.outbox.lanes,
            lease_seconds=settings.lane_lease_seconds,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self.wake = WakeUp()
        self._stop = self.lifecycle.stopping
        self._idle = False
        self._sparse = False  # the last batch had one or two rows: light traffic
        self._rotate = 0
        self._batch_counted = False  # this batch's slow acks were counted as a Kafka error
        self._unready_source: str | None = None  # the side whose error made it not ready
        self._operations_readable = True
        # Recording a batch runs on this thread while the next batch is read and sent: the
        # next batch is sent only after this one was acknowledged, so order is unaffected.
        self._marker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-mark")
        self._ahead = ReadAhead()
        self._marking: Future[None] | None = None
        self._held: Held | None = None  # clean batches' records, written together (grouped)
        # Each owned lane's cursor, one batch ahead of the database's (relay/cursors.py).
        self._cursors: dict[int, Cursor] = {}
        # The server's incarnation they were read under (relay/history.py).
        self._incarnation: uuid.UUID | None = None
        self.publisher: Publisher | None = None
        self._scheduler: BackgroundScheduler | None = None
        self._listener: Listener | None = None

    def _pool(self, *, size: int, connect: dict[str, str] | None = None) -> Pool:
        """Pinged only after a second idle: a round trip per claim and per record otherwise."""
        return Pool(self._url, size=size, connect=connect,
                    answer_timeout_s=self.settings.database_answer_timeout_seconds or None,
                    ping_after_idle_s=PING_AFTER_IDLE_S)

    # --- probes -------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.lifecycle.ready()

    def healthy(self) -> bool:
        return self.lifecycle.healthy()

    def _not_ready(self, cause: str, source: str | None) -> None:
        """Not ready because of *source*'s error (the side whose answer makes it ready again)."""
        self.lifecycle.set_ready(False, cause)
        self._unready_source = source

    def _database_answered(self) -> None:
        """Ready again when only the database had failed: an idle relay sends nothing that
        could prove it otherwise, and would stay not ready until the next message."""
        if not self.lifecycle.is_ready and self._unready_source == "postgres":
            self.lifecycle.set_ready(True)

    def _transient(self, exc: BaseException, doing: str) -> str:
        """Count a transient error, report not ready, and say in one line what failed."""
        source = error_source(exc)
        if source is not None:
            self.metrics.transient_errors.labels(source).inc()
        reason = f"{doing} failed: {describe_briefly(exc)}"
        self._not_ready(reason, source)
        return reason

    # --- lifecycle ----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish its batch, hand back its lanes and return."""
        self.lifecycle.stop()
        self.wake.everywhere()

    def run(self) -> int:
        s = self.settings
        # The lanes first, on the marking thread (idle until the first batch): the heartbeat
        # waits on PostgreSQL while this thread imports the Kafka client and makes the
        # producer (0.1 s), instead of after them.
        first_beat = self._marker.submit(self.lanes.heartbeat)
        try:  # from here on, lanes may be taken: the shutdown gives them back
            client = describe_client(s.resolved_kafka_client())
            log.info(
                "relay %s starting (database %s, kafka %s with %s, %d lanes)",
                s.relay_id,
                redact(self._url),
                s.resolved_bootstrap(),
                client,
                self.outbox.lanes,
                extra={"event": "relay.start", "kafka_client": client},
            )
            self.lifecycle.serve_http(s.http_host, s.http_port, self.metrics.registry)
            self._listener = Listener(libpq_url(self._url), self.outbox.notify_channel,
                                      self.wake)
            self._listener.start()
            threading.Thread(target=self._open_pools, name="relay-open", daemon=True).start()
            self._connect(first_beat)
            self._start_scheduler()
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _connect(self, first_beat: Future[OwnedLanes] | None = None) -> None:
        """Create the producer and take lanes (*first_beat*: a heartbeat begun already),
        retrying transient failures with backoff."""
        while not self._stop.is_set():
            try:
                if self.publisher is None:
                    self.publisher = self._make_publisher()
                    self.publisher.admin_ahead()
                if first_beat is not None:
                    beat, first_beat = first_beat, None
                    beat.result()  # a failure is a transient one as below: beaten again
                else:
                    self.lanes.heartbeat()
                self.lifecycle.succeeded()
                return
            except ConfigurationError:
                raise
            except Exception as exc:
                self.lifecycle.back_off(self._transient(exc, "start-up"))

    def _open_pools(self) -> None:
        """Connect the claim's and the record's pools while the producer is made and the
        lanes taken: the first batch need not wait for two more connections."""
        for pool in (self.claim_pool, self.record_pool):
            try:
                with pool.connection():
                    pass
            except Exception as exc:  # the loop connects again, and reports it
                log.debug("connecting ahead failed: %s", describe_briefly(exc))
                return

    def _make_publisher(self) -> Publisher:
        try:
            return Publisher(self.settings)
        except (ValueError, TypeError) as exc:
            # The Kafka client's words for a bad config: retrying would not change them.
            raise ConfigurationError(f"the Kafka producer refused its settings: {exc}") from exc

    def _start_scheduler(self) -> None:
        s = self.settings
        sched = self.lifecycle.scheduler()
        now = datetime.now(UTC)
        sched.add_job(
            self._heartbeat_job,
            "interval",
            seconds=s.lane_lease_seconds / 3,
            id="lanes",
            next_run_time=now,
        )
        sched.add_job(self.wake.everywhere, "interval", seconds=s.poll_interval_seconds, id="poll")
        sched.add_job(
            self._job(self.lanes.forget_dead_relays),
            "interval",
            seconds=s.lane_lease_seconds,
            id="sweep",
        )
        if s.published_retention_seconds > 0:
            sched.add_job(
                self._job(self._retention),
                "interval",
                seconds=s.retention_interval_seconds,
                id="retention",
                next_run_time=now,
            )
        sched.add_job(
            self._job(self._refresh_metrics), "interval", seconds=5, id="metrics", next_run_time=now
        )
        sched.start()
        self._scheduler = sched

    def _job(self, fn: Callable[[], object]) -> Callable[[], None]:
        return self.lifecycle.job(fn, describe_briefly)

    def _heartbeat_job(self) -> None:
        """Renew and rebalance the lanes (a scheduler job; the loop goes on meanwhile)."""
        try:
            owned = self.lanes.heartbeat()
            self._database_answered()
            self.metrics.lanes_owned.set(len(owned.tokens))
            if owned.acquired:
                self.wake.everywhere()  # their rows may have waited a lease already: claim them now
            if owned.others_expire_in is not None:
                self._look_again_in(owned.others_expire_in)
        except psycopg.Error as exc:
            reason = self._transient(exc, "lane heartbeat")
            log.warning("%s", reason, extra={"event": "relay.heartbeat_failed"})

    def _look_again_in(self, seconds: float) -> None:
        """Run one more heartbeat just after another relay's lanes run out.

        The interval heartbeat alone would take them up to a third of a lease late.
        """
        if self._scheduler is None or self._stop.is_set():
            return
        # A little after the expiry: the heartbeat's acquire needs the lease to be over by the
        # database's clock; a look-again that comes too early schedules the next one itself.
        when = datetime.now(UTC) + timedelta(seconds=seconds + 0.05)
        self._scheduler.add_job(
            self._heartbeat_job, "date", run_date=when, id="lanes-expiry", replace_existing=True
        )

    def _retention(self) -> None:
        deleted = purge_published(
            self.pool,
            self.schema,
            older_than_s=self.settings.published_retention_seconds,
            batch=self.settings.retention_batch,
        )
        if deleted:
            log.info("deleted %d published rows", deleted, extra={"event": "relay.retention"})

    def _refresh_metrics(self) -> None:
        with self.pool.begin() as conn:
            found = read_backlog(conn, self.schema, lanes=self.outbox.lanes)
        self.metrics.backlog.set(found.backlog)
        self.metrics.oldest_pending_age.set(found.oldest_age)
        self.metrics.failed_rows.set(found.failed)
        if self._operations_readable:
            self._refresh_operations()

    def _refresh_operations(self) -> None:
        try:
            with self.pool.connection() as conn:
                row = one(conn, driver_sql("relay", "unsettled_operations", self.schema))
        except psycopg.ProgrammingError as exc:
            if exc.sqlstate not in OPERATIONS_UNREADABLE:
                raise
            self._operations_readable = False  # said once, not every 5 s
            log.warning(
                "cannot read %s.operations (%s), so outboxkit_relay_unsettled_operations is "
                "not exported; to export it, GRANT SELECT (status) ON %s.operations to the "
                "relay's role",
                self.schema,
                describe_briefly(exc),
                self.schema,
                extra={"event": "relay.operations_unreadable"},
            )
            return
        self.metrics.unsettled_operations.labels("unknown").set(row.unknown)
        self.metrics.unsettled_operations.labels("needs-human").set(row.needs_human)

    def _shutdown(self) -> None:
        self.lifecycle.stop_background()
        self._finish_marking()
        self._marker.shutdown(wait=True)
        self._ahead.close()
        try:
            self.lanes.leave()
        except Exception as exc:
            log.warning(
                "could not release lanes: %s",
                describe_briefly(exc),
                extra={"event": "relay.leave_failed"},
            )
        if self.publisher is not None:
            self.publisher.close(timeout_s=5)
        if self._listener is not None:
            self._listener.stop()
        self.wake.close()
        for pool in (self.pool, self.claim_pool, self.record_pool):
            pool.close()
        self.lifecycle.close()

    # --- the loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self.lifecycle.beat()
            self._record_due()
            self._give_back_excess()
            owned = self.lanes.owned()
            if not owned:
                self._wait()
                continue
            if self._idle and self._sparse and self.settings.idle_linger_ms and self.wake.is_set():
                # Woken while idle after a batch of one or two rows: let the commits right
                # behind this one join its batch. At light traffic that is what a relay's CPU
                # goes on: one whole claim-send-record cycle per wake-up (docs/relay.md, "Light
                # traffic"). Busier, the rows pile up during a cycle anyway: no wait.
                self._stop.wait(self.settings.idle_linger_ms / 1000)
            # From here on, a commit that notifies wakes the next wait (while idle).
            named = self.wake.take()
            lanes = owned if named is None or not self._idle else self._named(owned, named)
            if not lanes:
                self._wait()
                continue
            try:
                batch = self._claim(lanes)
                if not batch.rows and not self._idle:
                    self._declare_idle(True)
                    # Notifications that came while busy are stale now; a commit that slipped
                    # in before we declared ourselves idle is found by this second claim.
                    self.wake.take()
                    batch = self._claim(owned)
            except psycopg.Error as exc:
                refused_privilege(exc)
                self.lifecycle.back_off(self._transient(exc, "claiming"))
                continue
            if not batch.rows:
                self._database_answered()
                self._wait()
                continue
            self._sparse = len(batch.rows) <= SPARSE_BATCH
            if not self._idle and len(batch.rows) >= self.settings.batch_size:
                self._read_ahead(lanes, batch)  # busy: the next batch is there already
            try:
                clean = self._process(batch)
                drained = clean and len(batch.rows) < self.settings.batch_size
                if self._idle and not drained:
                    # After the batch, not before: a woken relay publishes first. A backlog
                    # makes it busy: the emits stop paying NOTIFY, and it claims until empty.
                    self._declare_idle(False)
                elif self._idle:
                    # A batch smaller than the limit read every lane to the end of its
                    # difference, and while idle every commit since the claim notifies: so
                    # sleep until woken, without a claim that would find nothing. Light
                    # traffic keeps the relay idle: one claim per wake-up, no flag flips.
                    self._database_answered()
                    self._wait()
            except Exception as exc:
                self._batch_failed(exc)

    def _batch_failed(self, exc: Exception) -> None:
        # The cursors stay where the database has them; the next claim reads again.
        self._cursors.clear()
        if self._held is not None:  # recorded before anything is read again
            self._held.due = 0.0
        if error_source(exc) is None:  # a bug, not an outage: keep the traceback
            log.exception(
                "publishing a batch failed unexpectedly",
                extra={"event": "relay.batch_crashed"},
            )
        self.lifecycle.back_off(self._transient(exc, "batch"))

    def _give_back_excess(self) -> None:
        """Give back the lanes over this relay's fair share, never with a batch of theirs
        being recorded: the new owner would read its rows from a cursor not moved yet and
        send them again."""
        if self.lanes.releasing():
            self._finish_marking()
            self.lanes.release_pending()

    def _wait(self) -> None:
        timeout = self.settings.poll_interval_seconds
        if self._held is not None:
            timeout = min(timeout, max(0.0, self._held.due - time.monotonic()))
        self.wake.wait(timeout)
        self._record_due()

    def _record_due(self) -> None:
        """Write the grouped records once due, without waiting for a database that does
        not answer (the loop goes on beating; the next batch waits for them)."""
        held, marking = self._held, self._marking
        if (held is not None and time.monotonic() >= held.due
                and (marking is None or marking.done())):
            self._write_held()

    def _named(self, owned: dict[int, int], named: set[int]) -> dict[int, int]:
        """The owned lanes notifications named, and those with a difference not read to its
        end (a wake-up while idle: every commit since the last claim notified its lane)."""
        return {
            lane: token
            for lane, token in owned.items()
            if lane in named or ((c := self._cursors.get(lane)) is not None and c.target)
        }

    def _claim(self, owned: dict[int, int]) -> Claimed:
        """The next rows of the owned lanes, read from this relay's cursors (one batch ahead
        of the database's while the previous batch is being recorded), or read already."""
        source = self._source(owned)
        batch = self._ahead.take(owned, source, self._incarnation)
        if batch is None:
            self._rotate += 1
            batch = self._read(source, self._rotate, self._incarnation)
        self._follow_incarnation(batch.incarnation)
        for lane, read in batch.reads.items():
            # An empty difference moves the cursor here only: nothing to record.
            self._cursors[lane] = read.cursor if read.ids else read.advanced(None)
        return batch

    def _source(self, owned: dict[int, int],
                cursors: Mapping[int, Cursor] | None = None) -> dict[int, Cursor | int]:
        """What a claim of *owned* reads from: each lane's cursor (this relay's, or the given
        *cursors*), or its token alone when there is none for its token."""
        cursors = self._cursors if cursors is None else cursors
        source: dict[int, Cursor | int] = {}
        for lane, token in owned.items():
            known = cursors.get(lane)
            source[lane] = known if known is not None and known.token == token else token
        return source

    def _read(self, source: Mapping[int, Cursor | int], rotate: int,
              incarnation: uuid.UUID | None) -> Claimed:
        """One claim (no state of the relay changed: it also runs on the read-ahead thread)."""
        with self.claim_pool.connection() as conn:
            return claim_messages(
                conn,
                self.schema,
                relay_id=self.settings.relay_id,
                cursors=source,
                limit=self.settings.batch_size,
                rotate=rotate,
                incarnation=incarnation,
            )

    def _read_ahead(self, owned: dict[int, int], batch: Claimed) -> None:
        """Read the batch after *batch* while it is sent (relay/readahead.py): from the
        cursors its lanes will have once every row of it is acknowledged."""
        assumed = dict(self._cursors)
        for lane, read in batch.reads.items():
            if read.ids:
                assumed[lane] = read.advanced(read.ids[-1])
        self._rotate += 1
        rotate, incarnation = self._rotate, self._incarnation
        self._ahead.start(lambda source: self._read(source, rotate, incarnation), owned,
                          self._source(owned, assumed), incarnation)

    def _follow_incarnation(self, now: uuid.UUID | None) -> None:
        """Drop the cursors read under another incarnation of the server than *now*.

        The claim already ignored them (it read the stored cursors); the lanes it did not
        read this time must not use them either.
        """
        if now != self._incarnation and self._cursors and self._incarnation is not None:
            log.warning(
                "the database restarted after a crash or a standby was promoted (server "
                "incarnation %s, the cursors were read under %s): reading the lanes again "
                "from their stored cursors; rows sent since those are sent again",
                now,
                self._incarnation,
                extra={"event": "relay.incarnation_changed"},
            )
            self._cursors.clear()
        self._incarnation = now

    def _declare_idle(self, idle: bool) -> None:
        with self.pool.begin() as conn:
            # A hint, not state: a lost flag is covered by the heartbeat's staleness rule.
            conn.execute(driver_sql("relay", "commit_without_flush", self.schema))
            conn.execute(
                driver_sql("relay", "set_idle", self.schema),
                {"idle": idle, "relay_id": self.settings.relay_id},
            )
        self._idle = idle

    def _process(self, batch: Claimed) -> bool:
        """Send and record *batch*; False when a row is still waiting for Kafka's answer."""
        assert self.publisher is not None
        self._batch_counted = False
        block = self.settings.on_permanent_failure == "block"
        # Rows of a blocked key join the queue behind the refused one, unsent.
        set_aside: list[OutboxRow] = []
        sendable: list[OutboxRow] = []
        for row in batch.rows:
            if not row.retry and row.lane_key in batch.blocked:
                set_aside.append(row)
            else:
                sendable.append(row)
        published, failed = self._publish(sendable) if sendable else ([], [])
        failpoint("relay.after_ack")
        outcome = self._sort_outcome(batch, sendable, published, failed, set_aside, block=block)
        # Every row acknowledged (no transient failure either: that batch backs off below),
        # nothing set aside or retried.
        clean = not failed and not set_aside and not any(r.retry for r in batch.rows)
        groupable = clean and self._idle and self.settings.record_group_ms > 0
        if groupable:  # observed now: its record is written up to record_group_ms later
            self._observe_latency(outcome[0])
        held = self._held
        if (groupable and held is not None and self._marking is None
                and time.monotonic() < held.due and held.takes(batch.incarnation, batch.tokens)):
            held.add(outcome[0], outcome[3], batch.tokens)
            self.lifecycle.succeeded()
            return True
        ok = self._finish_marking()  # at most one batch being recorded at a time
        if not ok:
            # The previous batch was not recorded: the database's cursors are behind ours.
            # Recording this one would move them past rows without proof: read them again.
            self._cursors.clear()
            return False
        if groupable:
            self._held = Held(outcome[0], dict(outcome[3]), batch.incarnation,
                              dict(batch.tokens),
                              time.monotonic() + self.settings.record_group_ms / 1000)
        elif self._idle:
            self._marking = self._mark_here(outcome, block, batch.incarnation, batch.tokens)
        else:
            self._marking = self._marker.submit(
                self._mark, *outcome, block, incarnation=batch.incarnation, tokens=batch.tokens
            )
        if not clean:
            self._ahead.drop()  # it was read before these failures were recorded
            # Only clean batches are recorded beside the next claim. A refusal must be
            # recorded first: in block mode it is what holds back the later rows of its key.
            # So must retried rows: the next claim would read them again from the failures.
            self._finish_marking()
        transient = [f for f in failed if not f.permanent]
        if transient:
            if not self._batch_counted:  # one error per batch, also when it was slow first
                self.metrics.transient_errors.labels("kafka").inc()
            reason = (
                f"{len(transient)} messages not acknowledged ({transient[0].error.splitlines()[0]})"
            )
            self._note_error(sorted({f.row.lane for f in transient}), reason)
            self._not_ready(reason, "kafka")
            self.lifecycle.back_off(reason)
            return False
        self.lifecycle.succeeded()
        return True

    def _sort_outcome(
        self,
        batch: Claimed,
        sent: list[OutboxRow],
        published: list[Published],
        failed: list[Failed],
        set_aside: list[OutboxRow],
        *,
        block: bool,
    ) -> Outcome:
        """What to record, and each lane's new cursor (moved here at once).

        A lane's cursor passes its rows up to the first one Kafka did not answer for good
        (a transient failure): that row and the lane's later rows are read and sent again.
        Rows neither acknowledged nor refused were held back behind a refused row of their
        key (block mode): they are set aside with it.
        """
        if not failed and not set_aside and len(published) == len(sent):
            return self._all_published(batch, published)
        answered = {p.row.id for p in published} | {f.row.id for f in failed if f.permanent}
        transient = {f.row.id for f in failed if not f.permanent}
        held = [r for r in sent if r.id not in answered and r.id not in transient]
        if held and not block:  # cannot happen: only block mode holds rows back
            raise AssertionError(f"{len(held)} rows neither acknowledged nor refused")
        set_aside = set_aside + held
        moved: dict[int, Cursor] = {}
        done_upto: dict[int, int] = {}
        for lane, read in batch.reads.items():
            done: int | None = None
            for row_id in read.ids:
                if row_id in transient:
                    break
                done = row_id
            self._cursors[lane] = read.advanced(done)
            if done is not None:
                done_upto[lane] = done
                moved[lane] = self._cursors[lane]

        def passed(row: OutboxRow) -> bool:
            return row.retry or row.id <= done_upto.get(row.lane, -1)

        recorded = [p for p in published if passed(p.row)]
        counts = Counter(p.row.lane for p in recorded if not p.row.retry)
        return (
            recorded,
            [f for f in failed if f.permanent and passed(f.row)],
            [r for r in set_aside if passed(r)],
            {lane: (cursor, counts[lane]) for lane, cursor in moved.items()},
        )

    def _mark_here(self, outcome: Outcome, block: bool, incarnation: uuid.UUID | None,
                   tokens: dict[int, int], *, observed: bool = False) -> Future[None]:
        """Light traffic: the batch recorded on the loop's thread. Handed to the marking
        thread, the record costs a thread's wake-up and sleep more per batch, which on these
        machines weighs as much as the statement's Python; nothing is claimed meanwhile
        anyway. One try only: when the database does not take it, the marking thread keeps
        trying (with back-off) while the loop goes on beating, as for a busy relay."""
        done = Future[None]()
        try:
            self._mark(*outcome, block, incarnation=incarnation, tokens=tokens, retry=False,
                       observed=observed)
        except psycopg.Error:
            return self._marker.submit(
                self._mark, *outcome, block, incarnation=incarnation, tokens=tokens,
                observed=observed,
            )
        except Exception as exc:  # _finish_marking reports it, as from the thread
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done

    def _observe_latency(self, published: list[Published]) -> None:
        """Creation to acknowledgement (right after it, or once the batch is recorded)."""
        now = time.time()
        observe = self.metrics.latency.observe
        for p in published:
            observe(max(0.0, now - p.row.created_s))

    def _all_published(
        self, batch: Claimed, published: list[Published]
    ) -> Outcome:
        """:meth:`_sort_outcome` of the usual batch, every row acknowledged: each lane's
        cursor passes all its rows."""
        moved: dict[int, tuple[Cursor, int]] = {}
        for lane, read in batch.reads.items():
            self._cursors[lane] = cursor = read.advanced(read.ids[-1] if read.ids else None)
            if read.ids:
                moved[lane] = (cursor, len(read.ids))
        return published, [], [], moved

    def _note_error(self, lanes: list[int], reason: str) -> None:
        try:
            with self.pool.begin() as conn:
                note_error(
                    conn, self.schema, relay_id=self.settings.relay_id, lanes=lanes, error=reason
                )
        except psycopg.Error as exc:
            log.debug("could not note the error on the lanes: %s", describe_briefly(exc))

    def _mark(
        self,
        published: list[Published],
        failed: list[Failed],
        set_aside: list[OutboxRow],
        moves: dict[int, tuple[Cursor, int]],
        block: bool,
        *,
        incarnation: uuid.UUID | None,
        tokens: dict[int, int],
        retry: bool = True,
        observed: bool = False,
    ) -> None:
        """Record a batch's outcome (on the marking thread) and count it; its latency too,
        unless *observed* at the acknowledgement already."""
        self._record(
            published, failed, set_aside, moves, block, incarnation=incarnation, tokens=tokens,
            retry=retry,
        )
        failpoint("relay.after_mark")
        if not observed:
            self._observe_latency(published)
        self.metrics.published.inc(len(published))
        self.metrics.failed.inc(len(failed))
        self.metrics.dead_lettered.inc(sum(1 for f in failed if f.offset is not None))

    @contextlib.contextmanager
    def _record_connection(self, single_statement: bool) -> Iterator[Connection]:
        """A transaction, or an autocommit connection when the record is one statement."""
        if not single_statement:
            with self.pool.begin() as conn:
                yield conn
            return
        with self.record_pool.connection() as conn:
            yield conn

    def _finish_marking(self) -> bool:
        """Wait for the batch being recorded, and for the grouped records after it; False
        when recording failed."""
        ok = self._write_held()
        return self._await_marking() and ok

    def _write_held(self) -> bool:
        """Write the grouped records (relay/grouped.py), after the record in flight; as for
        a light batch, a database that refuses leaves them to the marking thread. False when
        the record in flight failed: the cursors were cleared, so the held rows are read and
        sent again, and their record is dropped."""
        ok = self._await_marking()
        held, self._held = self._held, None
        if held is not None and ok:
            self._marking = self._mark_here(
                (held.published, [], [], held.moves), False, held.incarnation, held.tokens,
                observed=True)
        return ok

    def _await_marking(self) -> bool:
        if self._marking is None:
            return True
        ok = True
        try:
            self._marking.result()
        except Exception as exc:
            # Not recorded: the lanes' cursors did not move, so those rows are read and sent
            # again (duplicates with the same message ids). Nothing is lost.
            log.error(
                "recording a batch failed: %s",
                describe_briefly(exc),
                extra={"event": "relay.mark_failed"},
            )
            ok = False
            self._cursors.clear()
        self._marking = None
        return ok

    def _publish(self, rows: list[OutboxRow]) -> tuple[list[Published], list[Failed]]:
        """Send *rows* and sort the outcomes. Rows that may be over their topic's size limit
        are sent alone, between the rows before and after them (relay/segments.py): a refused
        batch in flight would let later rows of a key be written first."""
        assert self.publisher is not None
        s = self.settings
        block = s.on_permanent_failure == "block"
        problems = self.publisher.missing_topics({r.topic for r in rows})
        limits = self.publisher.size_limits({r.topic for r in rows} - set(problems))
        failed: list[Failed] = []
        to_send: list[tuple[OutboxRow, bool]] = []
        held_keys: set[tuple[str, bytes]] = set()
        for row in rows:
            if row.topic in problems:
                failed.append(Failed(row, problems[row.topic], True))
                continue
            if row.key is not None and (row.topic, row.key) in held_keys:
                continue  # behind a refused message of its key: stays pending, order kept
            size = record_bytes(row)
            if size > s.max_request_bytes:
                failed.append(
                    Failed(
                        row,
                        f"MessageSizeTooLargeError: {size} bytes is over the "
                        f"producer's max request size of {s.max_request_bytes}",
                        True,
                    )
                )
                if block and row.key is not None:
                    held_keys.add((row.topic, row.key))
                continue
            to_send.append((row, suspect(row, size, limits)))
        published: list[Published] = []
        parts = segments(to_send)
        for index, part in enumerate(parts):
            # A key refused in an earlier part is held back in this one (block mode).
            sendable = part if not held_keys else [
                r for r in part if r.key is None or (r.topic, r.key) not in held_keys]
            ok, bad = self._send_part(sendable) if sendable else ([], [])
            published += ok
            failed += bad
            if any(not f.permanent for f in bad):
                # The lane's cursor stops at the first row without an answer: what comes
                # after it is read and sent again, after it.
                failed += [
                    Failed(row, "not sent yet: a transient error came first", False)
                    for later in parts[index + 1:]
                    for row in later
                ]
                break
            for f in bad:
                self.publisher.forget_limit(f.row.topic)
                if block and f.row.key is not None:
                    held_keys.add((f.row.topic, f.row.key))
        if s.on_permanent_failure == "dead-letter":
            failed = [
                self.publisher.dead_letter(f) if f.permanent and f.row.topic not in problems else f
                for f in failed
            ]
        return published, failed

    def _send_part(self, rows: list[OutboxRow]) -> tuple[list[Published], list[Failed]]:
        """Send *rows* in one go; when the broker refused some, tell the poison from its
        neighbours (:meth:`Publisher.isolate`)."""
        assert self.publisher is not None
        published, send_failed = self.publisher.send(rows, self._slow_acks)
        failed: list[Failed] = []
        if any(f.permanent for f in send_failed):
            self._warn_overtaken(published, send_failed)
            ok, refused, left = self.publisher.isolate(
                send_failed, block=self.settings.on_permanent_failure == "block"
            )
            published += ok
            failed += refused
            failed += [
                Failed(row, "not retried yet: a transient error came first", False) for row in left
            ]
        elif send_failed:
            self.publisher.reset()
            failed += send_failed
        return published, failed

    def _warn_overtaken(self, published: list[Published], failed: list[Failed]) -> None:
        """Say so when a later row of a refused row's key was written before it: the limits
        could not be read, or something else than the size was refused."""
        broken = overtaken((p.row for p in published), (f.row for f in failed))
        for refused, later in broken:
            log.error(
                "message %s (outbox row %s, topic %s, key %r) was refused in a batch while a "
                "later message of its key (row %s) was written: that key's order is broken "
                "in Kafka",
                refused.message_id,
                refused.id,
                refused.topic,
                refused.key,
                later.id,
                extra={"event": "relay.key_order_broken"},
            )

    def _slow_acks(self, waited: float) -> None:
        self.lifecycle.beat()  # waiting on Kafka is not being stuck
        if waited > SLOW_ACKS_SECONDS and not self._batch_counted:
            # A stopped or silent broker fails nothing until the delivery timeout (minutes):
            # counted once per batch, and not ready until it acknowledges.
            self._batch_counted = True
            self.metrics.transient_errors.labels("kafka").inc()
            self._not_ready(
                f"Kafka has not acknowledged a batch for {SLOW_ACKS_SECONDS:.0f} s", "kafka"
            )

    def _record(
        self,
        published: list[Published],
        failed: list[Failed],
        set_aside: list[OutboxRow],
        moves: dict[int, tuple[Cursor, int]],
        blocking: bool,
        *,
        incarnation: uuid.UUID | None,
        tokens: dict[int, int],
        retry: bool = True,
    ) -> None:
        """Record what Kafka said and move the cursors; keep trying (unless not *retry*:
        the error is raised), since giving up means re-sending. The statement moves no cursor
        of a lane taken over meanwhile, nor any after the server restarted from a crash or a
        standby was promoted since the batch was read (*incarnation*): its cursors may count
        re-issued transaction ids as seen."""
        attempt = 0
        while True:
            try:
                # A clean batch's record is one statement, its own transaction, and need not
                # wait for the WAL flush: if a database crash loses it, the cursors are back
                # where they were and the rows are sent again — duplicates with the same ids,
                # never a loss. (WAL is flushed in order, so no later record survives an
                # earlier lost one.) Refusals are recorded durably, in one transaction.
                clean = not failed and not set_aside and not any(p.row.retry for p in published)
                with self._record_connection(clean) as conn:
                    moved = record(
                        conn,
                        self.schema,
                        relay_id=self.settings.relay_id,
                        published=published,
                        failed=failed,
                        set_aside=set_aside,
                        cursors=moves,
                        blocking=blocking,
                        incarnation=incarnation,
                        tokens=tokens,
                        durable=not clean,
                    )
                lost = sorted(set(moves) - set(moved))
                if lost:
                    log.warning(
                        "lanes %s were not moved: taken over, or the database restarted "
                        "after a crash or failed over, before their batch was recorded; those "
                        "rows are read and sent again",
                        lost,
                        extra={"event": "relay.lanes_lost"},
                    )
                return
            except psycopg.Error as exc:
                if not retry:
                    raise
                attempt += 1
                self._transient(exc, "marking published rows")
                if self._stop.is_set() and attempt >= 3:
                    # Unmarked rows are published again after restart: duplicates with the
                    # same message id, which consumers drop. Nothing is lost.
                    log.error(
                        "could not mark %d published rows before shutdown: %s",
                        len(published),
                        describe_briefly(exc),
                        extra={"event": "relay.mark_failed"},
                    )
                    return
                # Not cut short by a stop: these rows are worth a few more tries (above).
                delay = self.backoff.delay(attempt)
                log.warning(
                    "marking published rows failed: %s; retrying in %.2f s",
                    describe_briefly(exc),
                    delay,
                    extra={"event": "relay.backoff"},
                )
                time.sleep(delay)
