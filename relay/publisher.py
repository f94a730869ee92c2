"""Sending claimed rows to Kafka and sorting the outcomes into published / failed.

A row counts as published only when the broker acknowledged it (acks=all, idempotent
producer); the partition and offset it got are the proof recorded with it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kafka import KafkaAdminClient, KafkaProducer, OffsetSpec, TopicPartition
from kafka import errors as kafka_errors
from kafka.admin import NewTopic

from outbox import tracing
from outbox.failpoints import failpoint
from relay.claims import Failed, OutboxRow, Published
from outbox.kafka.partitioner import CachedKeyPartitioner
from relay.settings import RelaySettings

log = logging.getLogger(__name__)

# Refusals that will not change by trying again: the message goes to the dead-letter topic
# (or blocks its key). Anything else is treated as transient: the row stays pending.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidRecordError,
    kafka_errors.CorruptRecordError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.UnsupportedForMessageFormatError,
    TypeError,
    ValueError,
)


# What a broker or the producer says of a record too large: a dead-letter copy is then
# tried again without the payload.
TOO_LARGE: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
)


def is_permanent(exc: BaseException) -> bool:
    return isinstance(exc, PERMANENT_ERRORS)


def kafka_headers(row: OutboxRow) -> list[tuple[str, bytes]]:
    """The envelope's headers as Kafka headers, plus the message id and type."""
    headers = [
        ("message-id", str(row.message_id).encode()),
        ("message-type", row.message_type.encode()),
    ]
    for name, value in row.headers.items():
        if value is None or name in ("message-id", "message-type"):
            continue
        headers.append((name, str(value).encode()))
    return headers


def publish_span(row: OutboxRow) -> Any:
    """A started PRODUCER span for sending *row*: the child of the context its emit recorded.

    Only call it when tracing is on (:func:`outbox.tracing.enabled`); end it with
    :func:`outbox.tracing.finish` once Kafka answered.
    """
    span = tracing.start_detached("outbox.publish", kind="producer", parent=row.headers)
    tracing.set_attributes(
        span,
        {
            "messaging.system": "kafka",
            "messaging.operation.type": "send",
            "messaging.destination.name": row.topic,
            "messaging.message.id": str(row.message_id),
            "messaging.message.body.size": len(row.payload),
            "outboxkit.run_id": row.headers.get("run-id"),
            "outboxkit.outbox_id": row.id,
        },
    )
    return span


def traced_headers(headers: list[tuple[str, bytes]], span: Any) -> list[tuple[str, bytes]]:
    """*headers* with the trace context replaced by *span*'s, so consumers are its children.

    The outbox row keeps the context of the emit; only the Kafka record carries the publish.
    """
    carried = tracing.trace_headers(span)
    if not carried:
        return headers
    kept = [(name, value) for name, value in headers if name not in tracing.TRACE_HEADERS]
    return kept + [(name, value.encode()) for name, value in carried.items()]


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def describe_briefly(exc: BaseException) -> str:
    """The first line of :func:`describe`: enough for a log line about an expected error.

    A dropped PostgreSQL connection's message runs over several lines (the server's hint,
    SQLAlchemy's link); none of them helps an operator more than the first.
    """
    return describe(exc).splitlines()[0] if str(exc) else type(exc).__name__


class Publisher:
    """One idempotent producer (acks=all) plus the admin client that checks topics."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        compression = None if settings.compression == "none" else settings.compression
        self._producer_config: dict[str, Any] = {
            **settings.kafka_client_config(),  # bootstrap servers, TLS/SASL
            "client_id": f"outboxkit-relay-{settings.relay_id}",
            "acks": "all",
            "enable_idempotence": True,
            # ≤ 5 keeps the idempotent producer's per-partition ordering guarantee.
            "max_in_flight_requests_per_connection": 5,
            "linger_ms": settings.linger_ms,
            "batch_size": settings.producer_batch_bytes,
            "compression_type": compression,
            "max_request_size": settings.max_request_bytes,
            "delivery_timeout_ms": settings.delivery_timeout_ms,
            # kafka-python refuses a delivery timeout below linger + request timeout.
            "request_timeout_ms": min(
                30_000, max(1, settings.delivery_timeout_ms - settings.linger_ms)
            ),
            "allow_auto_create_topics": False,
            "max_block_ms": 10_000,
            "partitioner": CachedKeyPartitioner(),
        }
        self.producer = KafkaProducer(**self._producer_config)
        self._admin: Any = None
        self._known_topics: set[str] = set()

    def reset(self) -> None:
        """Replace the producer: after a refused batch the idempotent producer can be left in
        a fatal state in which it fails every later send."""
        # Whatever it still held is unacknowledged, so still pending in the outbox.
        with contextlib.suppress(kafka_errors.KafkaError):
            self.producer.close(timeout=0)
        self.producer = KafkaProducer(**self._producer_config)

    def close(self, timeout_s: float = 10.0) -> None:
        try:
            self.producer.close(timeout=timeout_s)
        except kafka_errors.KafkaError as exc:
            # Unacknowledged records stay pending in the outbox: the next relay sends them.
            log.warning(
                "producer did not close cleanly: %s",
                describe(exc),
                extra={"event": "relay.producer_close_failed"},
            )
        if self._admin is not None:
            self._admin.close()

    def _admin_client(self) -> Any:
        if self._admin is None:
            self._admin = KafkaAdminClient(
                **self.settings.kafka_client_config(),
                client_id=f"outboxkit-relay-admin-{self.settings.relay_id}",
                request_timeout_ms=15_000,
            )
        return self._admin

    def missing_topics(self, topics: Iterable[str]) -> dict[str, str]:
        """Topics that do not exist and could not be created, with the reason for each."""
        unknown = set(topics) - self._known_topics
        if not unknown:
            return {}
        admin = self._admin_client()
        existing = set(admin.list_topics())
        self._known_topics |= existing & unknown
        missing = unknown - existing
        if not missing:
            return {}
        if not self.settings.create_topics:
            return {
                t: (
                    f"topic {t!r} does not exist and topic creation is off "
                    "(OUTBOXKIT_RELAY_CREATE_TOPICS=false): create the topic, then "
                    "retry the failed messages"
                )
                for t in missing
            }
        problems: dict[str, str] = {}
        for topic in sorted(missing):
            try:
                admin.create_topics(
                    [
                        NewTopic(
                            topic, self.settings.topic_partitions, self.settings.topic_replication
                        )
                    ]
                )
                log.info("created topic %s", topic, extra={"event": "relay.topic_created"})
            except kafka_errors.TopicAlreadyExistsError:
                pass
            except kafka_errors.InvalidTopicError as exc:
                problems[topic] = f"topic {topic!r} cannot be created: {describe(exc)}"
                continue
            self._known_topics.add(topic)
        self._wait_for_metadata(set(missing) - set(problems))
        return problems

    def _wait_for_metadata(self, topics: set[str]) -> None:
        """Wait until the producer knows each new topic and every partition's leader serves it.

        The broker's metadata names a partition's leader before that broker has taken the
        partition on: a produce sent in between is refused with NotLeaderForPartitionError,
        which the producer retries but logs as a warning, right after every topic creation.
        Only a partition's leader answers a ListOffsets request, so once each partition
        answered one, the first batch goes to leaders that accept it.
        """
        deadline = time.monotonic() + 10
        for topic in sorted(topics):
            partitions: set[int] | None = None
            while time.monotonic() < deadline:
                try:
                    partitions = self.producer.partitions_for(topic)
                    if partitions:
                        break
                except kafka_errors.KafkaError:
                    pass
                time.sleep(0.05)
            if not partitions:
                continue
            try:
                self._admin_client().list_partition_offsets(
                    {TopicPartition(topic, p): OffsetSpec.LATEST for p in partitions},
                    timeout_ms=max(100, int((deadline - time.monotonic()) * 1000)),
                )
            except kafka_errors.KafkaError as exc:
                # Not worth failing the batch for: the producer retries what a leader refuses.
                log.debug(
                    "the leaders of new topic %s did not all answer: %s",
                    topic,
                    describe_briefly(exc),
                    extra={"event": "relay.topic_leaders_wait"},
                )

    def send(
        self,
        rows: list[OutboxRow],
        on_wait: Callable[[float], None] | None = None,
    ) -> tuple[list[Published], list[Failed]]:
        """Send *rows*, wait for every acknowledgement, and sort the outcomes.

        *on_wait* is called about once a second with the seconds waited so far, so the
        daemon can report itself not ready while Kafka does not answer.
        """
        futures: list[tuple[OutboxRow, Any]] = []
        failed: list[Failed] = []
        # One check per batch: without a configured tracer no per-message span work at all.
        spans: dict[int, Any] | None = {} if tracing.enabled() else None
        for row in rows:
            headers = kafka_headers(row)
            if spans is not None:
                spans[row.id] = span = publish_span(row)
                headers = traced_headers(headers, span)
            try:
                future = self.producer.send(
                    row.topic, value=row.payload, key=row.key, headers=headers
                )
            except Exception as exc:
                failed.append(Failed(row, describe(exc), is_permanent(exc)))
                if spans is not None:
                    tracing.finish(spans.pop(row.id), error=exc)
                continue
            futures.append((row, future))
        failpoint("relay.after_send")
        self._await(futures, on_wait)
        published: list[Published] = []
        for row, future in futures:
            span = None if spans is None else spans.pop(row.id)
            if not future.is_done:
                failed.append(Failed(row, "KafkaTimeoutError: no acknowledgement in time", False))
                tracing.finish(span, error=failed[-1].error)
            elif future.failed():
                error = future.exception
                failed.append(Failed(row, describe(error), is_permanent(error)))
                tracing.finish(span, error=error)
            else:
                meta = future.value
                published.append(Published(row, meta.partition, meta.offset))
                if span is not None:
                    tracing.set_attributes(
                        span,
                        {
                            "messaging.destination.partition.id": str(meta.partition),
                            "messaging.kafka.offset": meta.offset,
                        },
                    )
                    tracing.finish(span)
        return published, failed

    def _await(
        self, futures: list[tuple[OutboxRow, Any]], on_wait: Callable[[float], None] | None
    ) -> None:
        """Wait until every future is resolved (or the delivery timeout passed).

        The loop watches our own futures rather than trusting flush(): when the broker
        refuses a batch as too large, kafka-python splits it and flush() can return early.
        """
        started = time.monotonic()
        limit = self.settings.delivery_timeout_ms / 1000 + 5
        while not all(f.is_done for _, f in futures):
            waited = time.monotonic() - started
            if waited >= limit:
                return
            try:
                self.producer.flush(timeout=min(1.0, max(0.01, limit - waited)))
            except kafka_errors.KafkaError:
                time.sleep(0.01)  # a batch was split or is still in flight: look again
            if waited >= 1 and on_wait is not None:
                on_wait(waited)

    def isolate(
        self,
        failed: list[Failed],
        *,
        block: bool,
    ) -> tuple[list[Published], list[Failed], list[OutboxRow]]:
        """Re-send refused rows one at a time, in order, to tell the poison from its neighbours.

        A broker refuses a whole record batch for one bad record, and kafka-python then
        fails everything after it; sent alone, only the truly bad record fails. Stops at the
        first transient failure: that row and every row after it stay pending, so no later
        message of a key overtakes an earlier one. With *block*, rows behind a refused one
        of the same key are not sent either (they stay pending, held back by the claim).
        Returns (published, refused, left pending).
        """
        self.reset()
        published: list[Published] = []
        permanent: list[Failed] = []
        held: set[tuple[str, bytes | None]] = set()
        rows = sorted((f.row for f in failed), key=lambda r: r.id)
        for index, row in enumerate(rows):
            if (row.topic, row.key) in held:
                continue
            ok, bad = self.send([row])
            published += ok
            if bad:
                self.reset()
                if not bad[0].permanent:
                    return published, permanent, rows[index:]
                permanent += bad
                if block and row.key is not None:
                    held.add((row.topic, row.key))
        return published, permanent, []

    def dead_letter(self, failure: Failed) -> Failed:
        """Copy a refused row to ``<topic><suffix>`` with the error in its headers.

        The copy carries the payload whenever Kafka takes it. When the payload is what is too
        large, the copy goes with an empty value and says so in its headers: the payload's
        size, and that the full payload is kept in ``outbox_failures`` under the outbox row's
        id (``x-outboxkit-outbox-id``) until an operator retries it (`outbox messages list
        --failed`).
        """
        row = failure.row
        topic = row.topic + self.settings.dlq_suffix
        evidence = [
            ("x-outboxkit-error", failure.error.encode()),
            ("x-outboxkit-original-topic", row.topic.encode()),
            ("x-outboxkit-outbox-id", str(row.id).encode()),
        ]
        problems = self.missing_topics([topic])
        if problems:
            return failure
        own = kafka_headers(row)
        attempts = [(row.payload, [*own, *evidence])]
        for kept in (own, own[:2]):  # then without the envelope's headers: they may be the bulk
            omitted = omitted_headers(row, topic, headers_too=kept is not own)
            attempts.append((b"", [*kept, *evidence, *omitted]))
        for value, headers in attempts:
            try:
                meta = self.producer.send(topic, value=value, key=row.key, headers=headers).get(
                    timeout=self.settings.delivery_timeout_ms / 1000
                )
            except TOO_LARGE:
                self.reset()  # a refused batch can leave the idempotent producer failing
                continue
            except Exception as exc:
                self.reset()
                log.warning(
                    "dead-lettering message %s failed: %s",
                    row.message_id,
                    describe_briefly(exc),
                    extra={"event": "relay.dead_letter_failed"},
                )
                return failure
            return Failed(row, failure.error, True, meta.partition, meta.offset)
        log.warning(
            "dead-lettering message %s failed: even its copy without payload or headers is "
            "too large for %s",
            row.message_id,
            topic,
            extra={"event": "relay.dead_letter_failed"},
        )
        return failure


def omitted_headers(row: OutboxRow, topic: str, *, headers_too: bool) -> list[tuple[str, bytes]]:
    """Headers that say what a dead-letter copy left out, and where to find it."""
    what = "payload and headers" if headers_too else "payload"
    note = (
        f"the {what} ({len(row.payload)} payload bytes) did not fit in {topic}; the full "
        f"message of outbox row {row.id} is kept in outbox_failures (`outbox messages list "
        "--failed`): read it there"
    )
    return [
        ("x-outboxkit-payload-omitted", note.encode()),
        ("x-outboxkit-payload-bytes", str(len(row.payload)).encode()),
    ]
