"""The relay daemon: claim a batch of owned lanes, send it, wait for the acks, mark it.

The loop is single-threaded on purpose: one batch in flight at a time keeps the order of
each lane obvious. Background work (lane heartbeats, the fallback poll, sweeping dead
relays, retention, metrics) runs as APScheduler jobs whose bodies are plain functions.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import psycopg
from apscheduler.schedulers.background import BackgroundScheduler
from kafka import errors as kafka_errors
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import ProgrammingError, SQLAlchemyError

from outbox.dsn import libpq_url, redact, sqlalchemy_url
from outbox.errors import ConfigurationError
from outbox.failpoints import failpoint
from outbox.settings import OutboxSettings
from relay.claims import Failed, OutboxRow, Published, claim, record
from relay.http import HealthServer
from relay.lanes import LaneManager
from relay.metrics import RelayMetrics
from relay.publisher import Publisher, describe_briefly
from relay.retention import purge_published
from relay.settings import RelaySettings
from relay.sql import sql
from relay.wakeup import SET_IDLE, Listener

log = logging.getLogger(__name__)

# Cheap at any backlog: the count stops at a cap, and the oldest pending row is found by
# one index probe per lane (the pending index is ordered by id, and ids grow with time).
BACKLOG = """
SELECT (SELECT count(*) FROM (SELECT 1 FROM {schema}.outbox_messages
                              WHERE status = 'pending' LIMIT :cap) AS capped) AS backlog,
       (SELECT coalesce(extract(epoch FROM now() - min(head.created_at)), 0)
        FROM generate_series(0, :lanes - 1) AS l(lane)
        CROSS JOIN LATERAL (SELECT created_at FROM {schema}.outbox_messages
                            WHERE lane = l.lane AND status = 'pending'
                            ORDER BY id LIMIT 1) AS head) AS oldest_age,
       (SELECT count(*) FROM {schema}.outbox_messages WHERE status = 'failed') AS failed
"""
BACKLOG_CAP = 1_000_000

# Operations whose outcome nobody has established (the ledger of dedup.perform), for an alert:
# the status index makes this cheap. Its own statement, since a least-privileged relay role
# may not read the table (then the gauge is simply not exported).
UNSETTLED_OPERATIONS = """
SELECT count(*) FILTER (WHERE status = 'unknown') AS unknown,
       count(*) FILTER (WHERE status = 'needs-human') AS needs_human
FROM {schema}.operations WHERE status IN ('unknown', 'needs-human')
"""
# The relay's role may not read it (least privilege), or the schema predates it.
OPERATIONS_UNREADABLE = frozenset({"42501", "42P01"})  # insufficient privilege, no such table

# A batch whose acknowledgements take longer than this makes the relay not ready (and counts
# as one transient Kafka error): the broker is stopped, unreachable or not answering.
SLOW_ACKS_SECONDS = 5.0


def error_source(exc: BaseException) -> str | None:
    """Which side a transient error came from (a label value), or None for anything else."""
    if isinstance(exc, SQLAlchemyError | psycopg.Error):
        return "postgres"
    if isinstance(exc, kafka_errors.KafkaError):
        return "kafka"
    return None


class Relay:
    """One relay process. ``run()`` blocks until ``stop()`` (e.g. from a signal handler)."""

    def __init__(
        self, settings: RelaySettings, outbox_settings: OutboxSettings | None = None
    ) -> None:
        self.settings = settings
        self.outbox = outbox_settings or OutboxSettings()
        url = settings.resolved_database_url()
        if not url:
            raise ConfigurationError(
                "no database URL: set OUTBOXKIT_RELAY_DATABASE_URL (or OUTBOXKIT_DATABASE_URL) "
                "or pass --database-url"
            )
        if not settings.resolved_bootstrap():
            raise ConfigurationError(
                "no Kafka bootstrap servers: set OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP (or "
                "OUTBOXKIT_KAFKA_BOOTSTRAP) or pass --kafka-bootstrap"
            )
        self._url = url
        self.schema = self.outbox.schema_name
        self.engine: Engine = create_engine(
            sqlalchemy_url(url), pool_size=3, max_overflow=2, pool_pre_ping=True
        )
        self.metrics = RelayMetrics()
        self.lanes = LaneManager(
            self.engine,
            schema=self.schema,
            relay_id=settings.relay_id,
            lanes=self.outbox.lanes,
            lease_seconds=settings.lane_lease_seconds,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._ready = False
        self._last_loop = time.monotonic()
        self._idle = False
        self._rotate = 0
        self._failures = 0
        self._batch_counted = False  # this batch's slow acks were counted as a Kafka error
        self._unready_source: str | None = None  # the side whose error made it not ready
        self._operations_readable = True
        # Marking a batch runs on this thread while the next batch is claimed and sent: the
        # next batch is sent only after this one was acknowledged, so order is unaffected.
        self._marker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-mark")
        self._marking: Future[None] | None = None
        self._in_flight: list[int] = []
        self.publisher: Publisher | None = None
        self.http: HealthServer | None = None
        self._scheduler: BackgroundScheduler | None = None
        self._listener: Listener | None = None

    # --- probes -------------------------------------------------------------------------
    def ready(self) -> bool:
        return self._ready and not self._stop.is_set()

    def healthy(self) -> bool:
        # A loop stuck longer than one delivery timeout plus slack is not healthy.
        bound = self.settings.delivery_timeout_ms / 1000 + 60
        return time.monotonic() - self._last_loop < bound

    def _set_ready(self, value: bool, cause: str = "") -> None:
        """Say so when readiness changes: becoming not ready is a warning that names *cause*."""
        if value != self._ready:
            if value:
                log.info(
                    "relay %s is ready", self.settings.relay_id, extra={"event": "relay.ready"}
                )
            else:
                log.warning(
                    "relay %s is not ready: %s",
                    self.settings.relay_id,
                    cause or "reason unknown",
                    extra={"event": "relay.not_ready"},
                )
        self._ready = value
        if value:
            self._unready_source = None
        self.metrics.ready.set(1 if value else 0)

    def _database_answered(self) -> None:
        """Ready again when only the database had failed: an idle relay sends nothing that
        could prove it otherwise, and would stay not ready until the next message."""
        if not self._ready and self._unready_source == "postgres":
            self._set_ready(True)

    def _transient(self, exc: BaseException, doing: str) -> str:
        """Count a transient error, report not ready, and say in one line what failed."""
        source = error_source(exc)
        if source is not None:
            self.metrics.transient_errors.labels(source).inc()
        reason = f"{doing} failed: {describe_briefly(exc)}"
        self._set_ready(False, reason)
        self._unready_source = source
        return reason

    # --- lifecycle ----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to finish its batch, hand back its lanes and return."""
        self._stop.set()
        self.wake.set()

    def run(self) -> int:
        s = self.settings
        log.info(
            "relay %s starting (database %s, kafka %s, %d lanes)",
            s.relay_id,
            redact(self._url),
            s.resolved_bootstrap(),
            self.outbox.lanes,
            extra={"event": "relay.start"},
        )
        if s.http_port:
            self.http = HealthServer(
                s.http_host, s.http_port, self.metrics.registry, self.healthy, self.ready
            )
            self.http.start()
        self._listener = Listener(libpq_url(self._url), self.outbox.notify_channel, self.wake)
        self._listener.start()
        try:
            self._connect()
            self._start_scheduler()
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _connect(self) -> None:
        """Create the producer and take lanes, retrying transient failures with backoff."""
        while not self._stop.is_set():
            try:
                if self.publisher is None:
                    self.publisher = self._make_publisher()
                self.lanes.heartbeat()
                self._failures = 0
                self._set_ready(True)
                return
            except ConfigurationError:
                raise
            except Exception as exc:
                self._backoff(self._transient(exc, "start-up"))

    def _make_publisher(self) -> Publisher:
        try:
            return Publisher(self.settings)
        except (ValueError, TypeError, kafka_errors.KafkaConfigurationError) as exc:
            # kafka-python's words for a bad config: retrying would not change them.
            raise ConfigurationError(f"the Kafka producer refused its settings: {exc}") from exc

    def _start_scheduler(self) -> None:
        s = self.settings
        sched = BackgroundScheduler(
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
        )
        now = datetime.now(UTC)
        sched.add_job(
            self._heartbeat_job,
            "interval",
            seconds=s.lane_lease_seconds / 3,
            id="lanes",
            next_run_time=now,
        )
        sched.add_job(self.wake.set, "interval", seconds=s.poll_interval_seconds, id="poll")
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

    def _job(self, fn: object) -> object:
        def run() -> None:
            try:
                fn()  # type: ignore[operator]
            except Exception as exc:
                log.warning(
                    "relay job %s failed: %s",
                    getattr(fn, "__name__", fn),
                    describe_briefly(exc),
                    extra={"event": "relay.job_failed"},
                )

        return run

    def _heartbeat_job(self) -> None:
        """Renew and rebalance the lanes (a scheduler job; the loop goes on meanwhile)."""
        try:
            owned = self.lanes.heartbeat()
            self._database_answered()
            self.metrics.lanes_owned.set(len(owned.tokens))
            if owned.acquired:
                self.wake.set()  # their rows may have waited a lease already: claim them now
            if owned.others_expire_in is not None:
                self._look_again_in(owned.others_expire_in)
        except SQLAlchemyError as exc:
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
            self.engine,
            self.schema,
            older_than_s=self.settings.published_retention_seconds,
            batch=self.settings.retention_batch,
        )
        if deleted:
            log.info("deleted %d published rows", deleted, extra={"event": "relay.retention"})

    def _refresh_metrics(self) -> None:
        with self.engine.connect() as conn:
            row = conn.execute(
                sql(BACKLOG, self.schema), {"cap": BACKLOG_CAP, "lanes": self.outbox.lanes}
            ).one()
        self.metrics.backlog.set(row.backlog)
        self.metrics.oldest_pending_age.set(float(row.oldest_age or 0))
        self.metrics.failed_rows.set(row.failed)
        if self._operations_readable:
            self._refresh_operations()

    def _refresh_operations(self) -> None:
        try:
            with self.engine.connect() as conn:
                row = conn.execute(sql(UNSETTLED_OPERATIONS, self.schema)).one()
        except ProgrammingError as exc:
            if getattr(exc.orig, "sqlstate", None) not in OPERATIONS_UNREADABLE:
                raise
            self._operations_readable = False  # said once, not every 5 s
            log.warning(
                "cannot read %s.operations (%s), so outboxkit_relay_unsettled_operations is "
                "not exported; to export it, GRANT SELECT (status) ON %s.operations to the "
                "relay's role",
                self.schema, describe_briefly(exc), self.schema,
                extra={"event": "relay.operations_unreadable"},
            )
            return
        self.metrics.unsettled_operations.labels("unknown").set(row.unknown)
        self.metrics.unsettled_operations.labels("needs-human").set(row.needs_human)

    def _shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
        self._finish_marking()
        self._marker.shutdown(wait=True)
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
        if self.http is not None:
            self.http.stop()
        self.engine.dispose()
        log.info("relay %s stopped", self.settings.relay_id, extra={"event": "relay.stop"})

    # --- the loop -----------------------------------------------------------------------
    def _backoff(self, reason: str) -> None:
        s = self.settings
        delay = min(s.backoff_max_seconds, s.backoff_initial_seconds * 2**self._failures)
        delay *= random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not cryptography
        self._failures += 1
        log.warning("%s; retrying in %.2f s", reason, delay, extra={"event": "relay.backoff"})
        self._stop.wait(delay)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._last_loop = time.monotonic()
            self.lanes.release_pending()
            owned = self.lanes.owned()
            if not owned:
                self._wait()
                continue
            try:
                rows = self._claim(owned)
                if not rows and self._marking is not None:
                    self._finish_marking()  # our own batch, still being marked
                    rows = self._claim(owned)
                if not rows and not self._idle:
                    self._declare_idle(True)
                    # Notifications that came while busy are stale now; a commit that slipped
                    # in before we declared ourselves idle is found by this second claim.
                    self.wake.clear()
                    rows = self._claim(owned)
            except SQLAlchemyError as exc:
                self._backoff(self._transient(exc, "claiming"))
                continue
            if not rows:
                self._database_answered()
                self._wait()
                continue
            try:
                self._process(rows)
                if self._idle:
                    # After the batch, not before: a woken relay publishes first. Emits that
                    # notify meanwhile cost little; this one commit would cost every wake-up.
                    self._declare_idle(False)
            except Exception as exc:
                # The batch's rows stay pending (or were marked); the next claim retries them.
                if error_source(exc) is None:  # a bug, not an outage: keep the traceback
                    log.exception(
                        "publishing a batch failed unexpectedly",
                        extra={"event": "relay.batch_crashed"},
                    )
                self._backoff(self._transient(exc, "batch"))

    def _wait(self) -> None:
        self.wake.wait(self.settings.poll_interval_seconds)
        self.wake.clear()

    def _claim(self, owned: dict[int, int]) -> list[OutboxRow]:
        self._rotate += 1
        with self.engine.begin() as conn:
            return claim(
                conn,
                self.schema,
                relay_id=self.settings.relay_id,
                lanes=owned,
                limit=self.settings.batch_size,
                rotate=self._rotate,
                exclude=self._in_flight if self._marking is not None else (),
            )

    def _declare_idle(self, idle: bool) -> None:
        with self.engine.begin() as conn:
            # A hint, not state: a lost flag is covered by the heartbeat's staleness rule.
            conn.exec_driver_sql("SET LOCAL synchronous_commit TO off")
            conn.execute(
                sql(SET_IDLE, self.schema), {"idle": idle, "relay_id": self.settings.relay_id}
            )
        self._idle = idle

    def _process(self, rows: list[OutboxRow]) -> None:
        assert self.publisher is not None
        self._batch_counted = False
        published, failed = self._publish(rows)
        failpoint("relay.after_ack")
        self._finish_marking()  # at most one batch being marked at a time
        self._in_flight = [p.row.id for p in published] + [f.row.id for f in failed]
        self._marking = self._marker.submit(self._mark, published, failed)
        if failed:
            # Only clean batches are marked beside the next claim. A failed row must be
            # recorded first: in block mode it is what holds back the later rows of its key
            # (the claim skips keys with a blocking failed row), and a retry must see it.
            self._finish_marking()
        transient = [f for f in failed if not f.permanent]
        if transient:
            if not self._batch_counted:  # one error per batch, also when it was slow first
                self.metrics.transient_errors.labels("kafka").inc()
            reason = (
                f"{len(transient)} messages not acknowledged "
                f"({transient[0].error.splitlines()[0]})"
            )
            self._set_ready(False, reason)
            self._unready_source = "kafka"
            self._backoff(reason)
        else:
            self._failures = 0
            self._set_ready(True)

    def _mark(self, published: list[Published], failed: list[Failed]) -> None:
        """Record a batch's outcome (on the marking thread) and count it."""
        self._record(published, failed)
        failpoint("relay.after_mark")
        now = time.time()
        for p in published:
            self.metrics.latency.observe(max(0.0, now - p.row.created_at.timestamp()))
        self.metrics.published.inc(len(published))
        permanent = [f for f in failed if f.permanent]
        self.metrics.failed.inc(len(permanent))
        self.metrics.dead_lettered.inc(sum(1 for f in permanent if f.offset is not None))

    def _finish_marking(self) -> None:
        """Wait for the batch being marked; its rows leave the exclusion list."""
        if self._marking is None:
            return
        try:
            self._marking.result()
        except Exception as exc:
            # Not marked: those rows are still pending and will be sent again (duplicates
            # with the same message ids). Nothing is lost.
            log.error(
                "marking a batch failed: %s",
                describe_briefly(exc),
                extra={"event": "relay.mark_failed"},
            )
        self._marking = None
        self._in_flight = []

    def _publish(self, rows: list[OutboxRow]) -> tuple[list[Published], list[Failed]]:
        assert self.publisher is not None
        s = self.settings
        problems = self.publisher.missing_topics({r.topic for r in rows})
        failed: list[Failed] = []
        sendable: list[OutboxRow] = []
        held_keys: set[tuple[str, bytes]] = set()
        for row in rows:
            if row.topic in problems:
                failed.append(Failed(row, problems[row.topic], True))
                continue
            key = (row.topic, row.key or b"")
            if row.key is not None and key in held_keys:
                continue  # behind a refused message of its key: stays pending, order kept
            size = (
                len(row.payload)
                + len(row.key or b"")
                + sum(len(k) + len(str(v)) for k, v in row.headers.items())
            )
            if size > s.max_request_bytes:
                failed.append(
                    Failed(
                        row,
                        f"MessageSizeTooLargeError: {size} bytes is over the "
                        f"producer's max request size of {s.max_request_bytes}",
                        True,
                    )
                )
                if s.on_permanent_failure == "block" and row.key is not None:
                    held_keys.add(key)
                continue
            sendable.append(row)
        published, send_failed = (
            self.publisher.send(sendable, self._slow_acks) if sendable else ([], [])
        )
        if any(f.permanent for f in send_failed):
            ok, refused, left = self.publisher.isolate(
                send_failed, block=s.on_permanent_failure == "block"
            )
            published += ok
            failed += refused
            failed += [
                Failed(row, "not retried yet: a transient error came first", False) for row in left
            ]
        elif send_failed:
            self.publisher.reset()
            failed += send_failed
        if s.on_permanent_failure == "dead-letter":
            failed = [
                self.publisher.dead_letter(f) if f.permanent and f.row.topic not in problems else f
                for f in failed
            ]
        return published, failed

    def _slow_acks(self, waited: float) -> None:
        self._last_loop = time.monotonic()  # waiting on Kafka is not being stuck
        if waited > SLOW_ACKS_SECONDS and not self._batch_counted:
            # A stopped or silent broker fails nothing until the delivery timeout (minutes):
            # counted once per batch, and not ready until it acknowledges.
            self._batch_counted = True
            self.metrics.transient_errors.labels("kafka").inc()
            self._set_ready(
                False, f"Kafka has not acknowledged a batch for {SLOW_ACKS_SECONDS:.0f} s"
            )
            self._unready_source = "kafka"

    def _record(self, published: list[Published], failed: list[Failed]) -> None:
        """Mark what Kafka acknowledged; keep trying, since giving up means re-sending."""
        blocking = self.settings.on_permanent_failure == "block"
        delay = self.settings.backoff_initial_seconds
        attempt = 0
        while True:
            try:
                with self.engine.begin() as conn:
                    if not failed:
                        # A clean batch's mark need not wait for the WAL flush: if a database
                        # crash loses it, the rows are pending again and re-sent — duplicates
                        # with the same ids, never a loss. (WAL is flushed in order, so no
                        # later mark survives an earlier lost one.) Failed marks stay durable.
                        conn.exec_driver_sql("SET LOCAL synchronous_commit TO off")
                    record(conn, self.schema, published, failed, blocking=blocking)
                return
            except SQLAlchemyError as exc:
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
                log.warning(
                    "marking published rows failed: %s; retrying in %.2f s",
                    describe_briefly(exc),
                    delay,
                    extra={"event": "relay.backoff"},
                )
                time.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter
                delay = min(self.settings.backoff_max_seconds, delay * 2)
