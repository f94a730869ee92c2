"""After a message failed: its attempt counted, then parked for a retry or dead-lettered.

The attempt is counted in the failures table (so restarts do not reset the count). A
message without a usable id or payload, or whose handler raised ``DeadLetter``, goes to the
dead-letter topic at once; others after ``max_attempts`` attempts, unless an operation they
started is still open in the ledger (its outcome will still be learnt: the message waits
for it, :mod:`dedup.ledger.outstanding`). A parked message's partition waits until the retry is due
(:mod:`consumers.parking`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine

from consumers import failures
from consumers.app import Consumer
from consumers.control import DeadLetter, RetryLater
from consumers.deadletter import Sent, dead_letter_headers, slim_copy
from consumers.decode import message_id_of
from consumers.errors import MalformedMessage
from consumers.failures import headers_json
from consumers.metrics import ConsumerMetrics
from consumers.parking import Parked
from dedup.inbox import Mark, mark
from dedup.ledger.operations import Operation
from dedup.ledger.outstanding import awaited_operation
from outbox.kafka import Record, RecordTooLarge

log = logging.getLogger(__name__)

SendDeadLetter = Callable[[str, bytes | None, bytes | None, list[tuple[str, bytes]]], Sent]
Committed = Callable[[Sequence[Record]], None]


class Retries:
    """Settles failed messages of one consumer group: count, then park or dead-letter."""

    def __init__(
        self,
        app: Consumer,
        engine: Engine,
        metrics: ConsumerMetrics,
        send_dead_letter: SendDeadLetter,
        committed: Committed,
    ) -> None:
        self.app = app
        self.settings = app.settings
        self.group = app.group_id
        self.engine = engine
        self.metrics = metrics
        self.send_dead_letter = send_dead_letter
        self.committed = committed

    def settle(
        self, record: Record, error: BaseException, *, conn: Connection | None = None
    ) -> Parked | None:
        """Count the failed attempt, then dead-letter the message (None) or park it.

        On *conn* when given (a handler thread's own, with no transaction open), else on
        connections of the pool; each write in a short transaction of its own."""
        attempt = self._count_attempt(record, error, conn)
        if attempt.status in ("dead-lettered", "replayed", "discarded"):
            # Dead-lettered (or replayed, or discarded) before: a redelivery of a message
            # without a mark. Move on.
            self.committed([record])
            return None
        if isinstance(error, MalformedMessage | DeadLetter):
            self._dead_letter(record, error, attempt.attempts, conn)
            return None
        delay = self.settings.backoff(attempt.attempts)
        if isinstance(error, RetryLater) and error.delay_s is not None:
            delay = error.delay_s
        awaited = None
        if attempt.attempts >= self.settings.max_attempts:
            awaited = self._awaited(record, conn)
            if awaited is None:
                self._dead_letter(record, error, attempt.attempts, conn)
                return None
            delay = max(delay, _until_check(awaited, self.settings.backoff_max_seconds))
        log.warning(
            "message at %s[%d]@%d failed (attempt %d%s), tried again in %.2f s: %s%s",
            record.topic,
            record.partition,
            record.offset,
            attempt.attempts,
            "" if awaited else f" of {self.settings.max_attempts}",
            delay,
            describe(error),
            "" if awaited is None else (
                f"; not dead-lettered: operation {awaited.id} ({awaited.operation} on "
                f"{awaited.system}) is {awaited.status.value}, its outcome is still expected"),
            extra={"event": "consumer.retry"},
        )
        return Parked(record.topic, record.partition, record.offset, time.monotonic() + delay)

    def _awaited(self, record: Record, conn: Connection | None) -> Operation | None:
        """An open ledger operation started for this message: its outcome is still due."""
        message_id = message_id_of(record)
        if message_id is None:
            return None
        with self._begin(conn) as tx:
            return awaited_operation(tx, message_id, settings=self.app.outbox_settings)

    def _begin(self, conn: Connection | None) -> AbstractContextManager[Connection]:
        """A short transaction on *conn*, or on a connection of the pool."""
        if conn is None:
            return self.engine.begin()
        return _transaction(conn)

    def _count_attempt(
        self, record: Record, error: BaseException, conn: Connection | None
    ) -> failures.Attempt:
        self.metrics.failures.labels(record.topic).inc()
        with self._begin(conn) as tx:
            return failures.record_attempt(
                tx,
                group=self.group,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                message_id=message_id_of(record),
                key=record.key,
                payload=record.value,
                headers=_storable(headers_json(record.headers or [])),
                error=describe(error),
            )

    def _dead_letter(
        self, record: Record, error: BaseException, attempts: int, conn: Connection | None
    ) -> None:
        topic = record.topic + self.settings.dlq_suffix
        headers = dead_letter_headers(
            record, error=describe(error), group=self.group, attempts=attempts
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
        with self._begin(conn) as tx:
            if message_id is not None:
                mark(
                    tx,
                    self.group,
                    Mark(message_id, record.topic, record.partition, record.offset),
                    settings=self.app.outbox_settings,
                )
            failures.mark_dead_lettered(
                tx,
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
            describe(error),
            extra={"event": "consumer.dead_lettered"},
        )
        self.committed([record])


@contextmanager
def _transaction(conn: Connection) -> Iterator[Connection]:
    with conn.begin():
        yield conn


def _until_check(operation: Operation, longest: float) -> float:
    """Seconds until the ledger next checks *operation*, at most *longest*."""
    if operation.next_check_at is None:
        return longest
    wait = (operation.next_check_at - datetime.now(UTC)).total_seconds()
    return min(longest, max(0.0, wait))


def describe(exc: BaseException) -> str:
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
