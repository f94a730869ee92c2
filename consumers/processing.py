"""Handling records with their dedup marks: the exactly-once-effect core of the consumer.

For each message, in one PostgreSQL transaction: insert its mark (group, message id); if
it was already there, the message is a duplicate and is dropped; otherwise the handler runs
on that same transaction, so its writes and the mark commit together. The caller commits
Kafka offsets only after the processor reported the commit (``committed``), so a crash in
between redelivers messages whose marks are there: dropped.

Batch mode puts a poll batch in one transaction: the marks in one statement, a savepoint
per message (per-message handlers) or per bisected chunk (batch handlers), so a failing
message is rolled back alone. The batch then commits what came before it; its attempt is
counted in the failures table (so restarts do not reset the count) and the message is
*parked*: nothing after it in its partition is handled, and its partition waits (paused by
the runner, :mod:`consumers.parking`) until the retry is due, while the batch goes on with
the other partitions. A retry is handled alone, before the rest of its batch. Messages with
no message id, a payload that is not JSON or does not fit the model, or whose handler raises
``DeadLetter`` go to the dead-letter topic at once; others after ``max_attempts`` attempts,
unless an operation they started is still open in the ledger (its outcome will still be
learnt: the message waits for it, :mod:`dedup.outstanding`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import IntegrityError

from consumers.app import Consumer
from consumers.control import DeadLetter, RetryLater, SkipMessage
from consumers.deadletter import Sent, dead_letter_headers, slim_copy
from consumers.decode import Decoded, decode, message_id_of
from consumers.errors import MalformedMessage
from consumers.handlers import Registration
from consumers.metrics import ConsumerMetrics
from consumers.parking import Parked
from consumers.pipeline import kept_inserts
from dedup import failures
from dedup.failures import headers_json
from dedup.inbox import Mark, Marks, insert_new, mark, mark_many, unmark
from dedup.operations import Operation
from dedup.outstanding import awaited_operation
from outbox.kafka import RecordTooLarge
from outbox.messages.envelope import HEADER_RUN_ID
from outbox.runtime import tracing
from outbox.runtime.failpoints import failpoint

log = logging.getLogger(__name__)

SendDeadLetter = Callable[[str, bytes | None, bytes | None, list[tuple[str, bytes]]], Sent]


class _HandlerFailed(Exception):
    """A handler raised inside the plain (savepoint-free) batch; carries where."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


@dataclass
class _Failed:
    index: int
    error: BaseException


@dataclass(frozen=True)
class Progress:
    """What :meth:`Processor.process` did with a batch.

    ``handled``: records done for good (committed, dropped as duplicates, skipped or
    dead-lettered). ``parked``: failed messages to retry later; nothing after one of them in
    its partition was handled.
    """

    handled: int
    parked: tuple[Parked, ...] = ()


Position = tuple[str, int, int]  # (topic, partition, offset)


class Processor:
    """Processes records in order; ``committed`` is called after each database commit."""

    def __init__(
        self,
        app: Consumer,
        engine: Engine,
        metrics: ConsumerMetrics,
        send_dead_letter: SendDeadLetter,
        *,
        stop: threading.Event | None = None,
        committed: Callable[[Sequence[Any]], None] = lambda records: None,
    ) -> None:
        self.app = app
        self.settings = app.settings
        self.group = app.group_id
        self.engine = engine
        self.metrics = metrics
        self.send_dead_letter = send_dead_letter
        self.stop = stop or threading.Event()
        self.committed = committed
        self._traced = tracing.enabled()

    # --- the entry point -----------------------------------------------------------------
    def process(
        self,
        records: Sequence[Any],
        retries: Collection[Position] = (),
        unsure: Sequence[Position] = (),
    ) -> Progress:
        """Handle *records* in partition order; park failed ones instead of waiting for them.

        *retries*: positions of records that are retries of parked messages; each is handled
        alone, first (it is the first record of its partition in the batch). *unsure*: first
        records of partitions read from elsewhere than where this process left them (its
        start, a rebalance, a rewind): those an earlier process parked (their failure row
        says ``retrying``) are retries too, so that handling them marks them ``recovered``.
        """
        # Whether spans are made, looked up once per batch rather than per message: a
        # tracer provider set meanwhile is picked up from the next batch on.
        self._traced = tracing.enabled()
        if unsure:
            with self.engine.connect() as conn:
                retries = {*retries, *failures.retrying_among(conn, group=self.group,
                                                              positions=unsure)}
        parked: list[Parked] = []
        pending = list(records)
        handled = 0
        heads = [r for r in pending if (r.topic, r.partition, r.offset) in retries] if (
            retries) else []
        for record in heads:
            if self.stop.is_set():
                return Progress(handled, tuple(parked))
            error = self._once(record, recovering=True)
            again = None if error is None else self._after_failure(record, error)
            if again is None:
                handled += 1
                pending.remove(record)
            else:
                parked.append(again)
                pending = _without_partition(pending, record)
        while pending and not self.stop.is_set():
            if self.settings.mode == "batch":
                ok, failed = self._batch(pending)
            else:
                ok, failed = self._one_by_one(pending)
            handled += ok
            if failed is None:
                pending = pending[ok:]
                continue
            bad, rest = pending[ok], pending[ok + 1 :]
            again = self._after_failure(bad, failed.error)
            if again is None:
                handled += 1
                pending = rest
            else:
                parked.append(again)
                pending = _without_partition(rest, bad)
        return Progress(handled, tuple(parked))

    # --- batch mode ----------------------------------------------------------------------
    def _batch(self, records: Sequence[Any]) -> tuple[int, _Failed | None]:
        decoded: list[Decoded] = []
        failed: _Failed | None = None
        for index, record in enumerate(records):
            try:
                decoded.append(decode(record, self._registration(record)))
            except MalformedMessage as exc:
                failed = _Failed(index, exc)
                break
        if not decoded:
            return 0, failed
        plain = self._plain(decoded)
        if plain is None:
            self.committed(records[: len(decoded)])
            return len(decoded), failed
        index, error = plain
        # The messages before the failing one succeed again without it: commit them, then
        # the failing one is settled alone (retried, counted, maybe dead-lettered).
        if (index >= 0 and not isinstance(error, SkipMessage)
                and (index == 0 or self._plain(decoded[:index]) is None)):
            self.committed(records[:index])
            return index, _Failed(index, error)
        with self.engine.connect() as conn, conn.begin():
            fresh, duplicates = self._mark_careful(conn, decoded)
            for d in duplicates:
                self._duplicate(d)
            ok, inner = self._handle_all(conn, fresh)
            if inner is not None:
                # Stop at the failing message: unmark it and everything after it in the batch.
                for d in fresh[inner.index :]:
                    unmark(conn, self.group, d.message_id, settings=self.app.outbox_settings)
                stop_at = decoded.index(fresh[inner.index])
                failed = _Failed(stop_at, inner.error)
                count_to = stop_at
            else:
                count_to = len(decoded)
        self._done(fresh[:ok])
        self.committed(records[:count_to])
        return count_to, failed

    def _plain(self, decoded: list[Decoded]) -> tuple[int, BaseException] | None:
        """The common case first: the batch in one transaction without savepoints.

        A savepoint costs two round trips per message and almost no batch has a failure,
        so the batch runs plainly. ``None`` means it committed. Otherwise everything was
        rolled back and the answer is (index in *decoded* of the message whose handler
        raised, or -1 when that is not known, and the error). Handlers' database writes roll
        back with it; their outside effects must be idempotent anyway (the operations
        ledger), as with any redelivery.
        """
        fresh: list[Decoded] = decoded
        duplicates: list[Decoded] = []
        # The handlers' plain INSERTs are kept and sent together, the transaction in
        # psycopg's pipeline mode (consumers.pipeline): an error among them surfaces later,
        # so it does not name its message; any error rolls the whole batch back, and the
        # careful path, without the pipeline, settles it.
        with self.engine.connect() as conn, kept_inserts(conn) as kept:
            tx = conn.begin()
            try:
                if not self._all_new(conn, decoded):
                    kept.discard()
                    tx.rollback()  # some were marked: the careful insert says which
                    tx = conn.begin()
                    fresh, duplicates = self._mark_careful(conn, decoded)
                at = self._call_all(conn, fresh)
                failpoint("consumer.after_handler")
                kept.send()  # the commit comes after every kept statement, and checks them
                tx.commit()
            except _HandlerFailed as failure:
                kept.discard()
                tx.rollback()
                index = -1 if failure.index < 0 else decoded.index(fresh[failure.index])
                return index, failure.error
            except Exception as exc:  # the commit itself failed: let the careful path decide
                kept.discard()
                tx.rollback()
                return -1, exc
        assert at == len(fresh)
        for d in duplicates:
            self._duplicate(d)
        self._done(fresh)
        return None

    def _mark_careful(
        self, conn: Connection, decoded: list[Decoded]
    ) -> tuple[list[Decoded], list[Decoded]]:
        """Mark the batch with ``ON CONFLICT DO NOTHING``: (fresh, duplicates) in order."""
        new = mark_many(conn, self.group, _marks(decoded), settings=self.app.outbox_settings)
        fresh: list[Decoded] = []
        duplicates: list[Decoded] = []
        for d in decoded:
            if d.message_id in new:
                new.discard(d.message_id)  # a second copy in this batch is a duplicate
                fresh.append(d)
            else:
                duplicates.append(d)
        return fresh, duplicates

    def _all_new(self, conn: Connection, decoded: list[Decoded]) -> bool:
        """Mark the batch with a plain INSERT, the common case; False if a mark was there
        (a redelivery; the transaction is then aborted and must be rolled back)."""
        if len({d.message_id for d in decoded}) < len(decoded):
            return False  # an id twice in the batch: the plain insert would refuse it anyway
        try:
            insert_new(conn, self.group, _marks(decoded), settings=self.app.outbox_settings)
        except IntegrityError:
            return False
        return True

    def _call_all(self, conn: Connection, items: list[Decoded]) -> int:
        """Every handler of *items*, in order (batch handlers get their topic's run at once)."""
        index = 0
        while index < len(items):
            registration = self._registration(items[index].record)
            assert registration is not None
            end = index + 1
            if registration.batch_handler is not None:
                while end < len(items) and items[end].record.topic == items[index].record.topic:
                    end += 1
            try:
                self._call(conn, registration, items[index:end])
            except Exception as exc:
                # Which message of a batch handler's run failed is not known: -1.
                raise _HandlerFailed(index if end == index + 1 else -1, exc) from exc
            index = end
        return index

    def _handle_all(self, conn: Connection, items: list[Decoded]) -> tuple[int, _Failed | None]:
        """Run the handlers in savepoints; stop at the first failure (ok count, failure)."""
        index = 0
        while index < len(items):
            registration = self._registration(items[index].record)
            assert registration is not None
            if registration.batch_handler is None:
                error = self._in_savepoint(conn, registration, [items[index]])
                if error is not None:
                    return index, _Failed(index, error)
                index += 1
                continue
            end = index
            while end < len(items) and items[end].record.topic == items[index].record.topic:
                end += 1
            bad = self._bisect(conn, registration, items[index:end])
            if bad is not None:
                return index + bad.index, _Failed(index + bad.index, bad.error)
            index = end
        return index, None

    def _bisect(
        self, conn: Connection, registration: Registration, items: list[Decoded]
    ) -> _Failed | None:
        error = self._in_savepoint(conn, registration, items)
        if error is None:
            return None
        if len(items) == 1:
            return _Failed(0, error)
        half = len(items) // 2
        first = self._bisect(conn, registration, items[:half])
        if first is not None:
            return first
        second = self._bisect(conn, registration, items[half:])
        return None if second is None else _Failed(half + second.index, second.error)

    def _in_savepoint(
        self, conn: Connection, registration: Registration, items: list[Decoded]
    ) -> BaseException | None:
        savepoint = conn.begin_nested()
        try:
            self._call(conn, registration, items)
        except SkipMessage as exc:
            savepoint.rollback()
            if len(items) > 1:
                return exc  # bisect down to the message that asked to be skipped
            self._skipped(items[0], exc)
            return None
        except Exception as exc:
            savepoint.rollback()
            return exc
        savepoint.commit()
        return None

    # --- per-message mode ----------------------------------------------------------------
    def _one_by_one(self, records: Sequence[Any]) -> tuple[int, _Failed | None]:
        for index, record in enumerate(records):
            if self.stop.is_set():
                return index, None
            error = self._once(record, recovering=False)
            if error is not None:
                return index, _Failed(index, error)
        return len(records), None

    def _once(self, record: Any, *, recovering: bool) -> BaseException | None:
        """One message in its own transaction; the error if it failed (nothing committed)."""
        try:
            decoded = decode(record, self._registration(record))
        except MalformedMessage as exc:
            return exc
        registration = self._registration(record)
        assert registration is not None
        with self.engine.connect() as conn:
            tx = conn.begin()
            try:
                if not mark(conn, self.group, _mark(decoded), settings=self.app.outbox_settings):
                    if recovering:  # handled meanwhile (by another process): recovered too
                        self._recovered(conn, record)
                    tx.commit()
                    self._duplicate(decoded)
                    self.committed([record])
                    return None
                try:
                    self._call(conn, registration, [decoded])
                except SkipMessage as exc:
                    tx.rollback()
                    with conn.begin():
                        mark(conn, self.group, _mark(decoded), settings=self.app.outbox_settings)
                    self._skipped(decoded, exc)
                    self.committed([record])
                    return None
                except Exception as exc:
                    tx.rollback()
                    return exc
                failpoint("consumer.after_handler")
                if recovering:
                    self._recovered(conn, record)
                tx.commit()
            finally:
                if tx.is_active:
                    tx.rollback()
        self._done([decoded])
        self.committed([record])
        return None

    def _recovered(self, conn: Connection, record: Any) -> None:
        failures.mark_recovered(
            conn, group=self.group, topic=record.topic, partition=record.partition,
            offset=record.offset,
        )

    # --- failures --------------------------------------------------------------------------
    def _after_failure(self, record: Any, error: BaseException) -> Parked | None:
        """Count the failed attempt, then dead-letter the message (None) or park it."""
        attempt = self._count_attempt(record, error)
        if attempt.status in ("dead-lettered", "replayed"):
            # Dead-lettered before (a redelivery of a message without a mark): move on.
            self.committed([record])
            return None
        if isinstance(error, MalformedMessage | DeadLetter):
            self._dead_letter(record, error, attempt.attempts)
            return None
        delay = self.settings.backoff(attempt.attempts)
        if isinstance(error, RetryLater) and error.delay_s is not None:
            delay = error.delay_s
        awaited = None
        if attempt.attempts >= self.settings.max_attempts:
            awaited = self._awaited(record)
            if awaited is None:
                self._dead_letter(record, error, attempt.attempts)
                return None
            delay = max(delay, _until_check(awaited, self.settings.backoff_max_seconds))
        log.warning(
            "message at %s[%d]@%d failed (attempt %d%s), partition waits %.2f s: %s%s",
            record.topic,
            record.partition,
            record.offset,
            attempt.attempts,
            "" if awaited else f" of {self.settings.max_attempts}",
            delay,
            _describe(error),
            "" if awaited is None else (
                f"; not dead-lettered: operation {awaited.id} ({awaited.operation} on "
                f"{awaited.system}) is {awaited.status.value}, its outcome is still expected"),
            extra={"event": "consumer.retry"},
        )
        return Parked(record.topic, record.partition, record.offset, time.monotonic() + delay)

    def _awaited(self, record: Any) -> Operation | None:
        """An open ledger operation started for this message: its outcome is still due."""
        message_id = message_id_of(record)
        if message_id is None:
            return None
        with self.engine.connect() as conn:
            return awaited_operation(conn, message_id, settings=self.app.outbox_settings)

    def _count_attempt(self, record: Any, error: BaseException) -> failures.Attempt:
        self.metrics.failures.labels(record.topic).inc()
        with self.engine.begin() as conn:
            return failures.record_attempt(
                conn,
                group=self.group,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                message_id=message_id_of(record),
                key=record.key,
                payload=record.value,
                headers=_storable(headers_json(record.headers or [])),
                error=_describe(error),
            )

    def _dead_letter(self, record: Any, error: BaseException, attempts: int) -> None:
        topic = record.topic + self.settings.dlq_suffix
        headers = dead_letter_headers(
            record, error=_describe(error), group=self.group, attempts=attempts
        )
        # Sent (and acknowledged) before the database records it: a crash in between sends
        # it again on redelivery (a duplicate in the dead-letter topic), never loses it.
        try:
            sent = self.send_dead_letter(topic, record.key, record.value, headers)
        except RecordTooLarge:
            # The error headers pushed a record near the limit over it: retrying would fail
            # for ever and stop the partition. The failures table has the bytes already.
            sent = self.send_dead_letter(topic, *slim_copy(record, headers))
        message_id = message_id_of(record)
        with self.engine.begin() as conn:
            if message_id is not None:
                mark(
                    conn,
                    self.group,
                    Mark(message_id, record.topic, record.partition, record.offset),
                    settings=self.app.outbox_settings,
                )
            failures.mark_dead_lettered(
                conn,
                group=self.group,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                dlq_topic=sent.topic,
                dlq_partition=sent.partition,
                dlq_offset=sent.offset,
            )
        self.metrics.dead_lettered.labels(record.topic).inc()
        log.error(
            "message at %s[%d]@%d dead-lettered to %s after %d attempts: %s",
            record.topic,
            record.partition,
            record.offset,
            topic,
            attempts,
            _describe(error),
            extra={"event": "consumer.dead_lettered"},
        )
        self.committed([record])

    # --- helpers ---------------------------------------------------------------------------
    def _registration(self, record: Any) -> Registration | None:
        return self.app.registrations.get(record.topic)

    def _call(self, conn: Connection, registration: Registration, items: list[Decoded]) -> None:
        if not self._traced:
            # No span to make: call straight (spans cost a provider lookup per message).
            self._invoke(conn, registration, items)
            return
        with self._span(items) as span:
            if span is not None:
                tracing.set_attributes(span, self._span_attributes(items))
            self._invoke(conn, registration, items)

    def _invoke(self, conn: Connection, registration: Registration, items: list[Decoded]) -> None:
        settings = self.app.outbox_settings
        if registration.batch_handler is not None:
            registration.batch_handler(
                [(d.context(conn, self.group, settings), d.payload) for d in items]
            )
            return
        assert registration.handler is not None
        assert len(items) == 1
        registration.handler(items[0].context(conn, self.group, settings), items[0].payload)

    def _span(self, items: list[Decoded]) -> AbstractContextManager[Any]:
        """``outbox.handle``, current around the handler (so its follow-ups join the trace).

        One message: the child of the context in its ``traceparent`` (the relay's publish).
        A batch handler's run: a span linked to each message's context. SkipMessage is an
        outcome, not an error; every other exception sets the span's error status.
        """
        if len(items) == 1:
            return tracing.start_span(
                "outbox.handle", kind="consumer", parent=items[0].headers, ok=(SkipMessage,)
            )
        return tracing.start_span(
            "outbox.handle",
            kind="consumer",
            parent={},  # a new trace: the messages' own traces are linked
            links=[d.headers for d in items],
            ok=(SkipMessage,),
        )

    def _span_attributes(self, items: list[Decoded]) -> dict[str, Any]:
        first = items[0]
        one = len(items) == 1
        return {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": first.record.topic,
            "messaging.consumer.group.name": self.group,
            "messaging.destination.partition.id": str(first.record.partition) if one else None,
            "messaging.kafka.offset": first.record.offset if one else None,
            "messaging.message.id": first.message_id if one else None,
            "messaging.batch.message_count": None if one else len(items),
            "outboxkit.run_id": (
                first.headers.get(HEADER_RUN_ID, b"").decode("utf-8", "replace") or None
                if one
                else None
            ),
        }

    def _duplicate(self, d: Decoded) -> None:
        self.metrics.duplicates.labels(d.record.topic).inc()
        log.debug(
            "dropped duplicate %s (%s[%d]@%d)",
            d.message_id,
            d.record.topic,
            d.record.partition,
            d.record.offset,
            extra={"event": "consumer.duplicate"},
        )

    def _skipped(self, d: Decoded, exc: SkipMessage) -> None:
        self.metrics.skipped.labels(d.record.topic).inc()
        log.info("skipped %s: %s", d.message_id, exc.reason, extra={"event": "consumer.skipped"})

    def _done(self, items: list[Decoded]) -> None:
        by_topic: dict[str, int] = {}
        for d in items:
            by_topic[d.record.topic] = by_topic.get(d.record.topic, 0) + 1
        for topic, n in by_topic.items():
            self.metrics.processed.labels(topic).inc(n)


def _without_partition(records: Sequence[Any], of: Any) -> list[Any]:
    """*records* less those of *of*'s partition (they wait behind it)."""
    return [r for r in records if (r.topic, r.partition) != (of.topic, of.partition)]


def _until_check(operation: Operation, longest: float) -> float:
    """Seconds until the ledger next checks *operation*, at most *longest*."""
    if operation.next_check_at is None:
        return longest
    wait = (operation.next_check_at - datetime.now(UTC)).total_seconds()
    return min(longest, max(0.0, wait))


def _mark(d: Decoded) -> Mark:
    return Mark(d.message_id, d.record.topic, d.record.partition, d.record.offset)


def _marks(decoded: list[Decoded]) -> Marks:
    """The batch's marks as columns (no Mark object per message)."""
    records = [d.record for d in decoded]
    return Marks(
        [d.message_id for d in decoded],
        [r.topic for r in records],
        [r.partition for r in records],
        [r.offset for r in records],
    )


def _describe(exc: BaseException) -> str:
    """The error as text any sink takes: PostgreSQL text, a UTF-8 Kafka header, a log line.

    A message can put anything in an error (the schema check quotes a payload's unknown
    field name, NUL and all; a handler may quote a lone surrogate from the payload); a sink
    that refused it would fail the batch on every redelivery, so such characters are escaped.
    """
    return _text(f"{type(exc).__name__}: {exc}")[:4000]


def _text(value: str) -> str:
    """*value* with NUL and lone surrogates backslash-escaped (storable, encodable)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def _storable(headers: dict[str, str]) -> dict[str, str]:
    """Header names and values jsonb accepts: it refuses ``\\u0000`` (a header can hold
    any bytes, and decoded UTF-8 can hold NUL)."""
    return {_text(name): _text(value) for name, value in headers.items()}
