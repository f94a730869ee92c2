"""Sending claimed rows to Kafka and sorting the outcomes into published / failed.

A row counts as published only when the broker acknowledged it (acks=all, idempotent
producer); the partition and offset it got are the proof recorded with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from outbox.kafka import (
    NO_OFFSET,
    Admin,
    Delivery,
    KafkaClientError,
    Outgoing,
    Producer,
    ProducerOptions,
    TopicExists,
    TopicInvalid,
    TopicPartition,
)
from outbox.messages.envelope import HEADER_RUN_ID
from outbox.runtime import tracing
from outbox.runtime.failpoints import failpoint
from relay.claims import Failed, OutboxRow, Published
from relay.segments import small_limit_warning
from relay.settings import RelaySettings

log = logging.getLogger(__name__)

# How long a topic's max.message.bytes is trusted. An operator who raises it gets at most an
# extra round trip per large message until it is read again; one who lowers it, a refusal,
# which drops the cached value at once. A limit that could not be read is asked again sooner.
TOPIC_LIMIT_TTL_S = 60.0
UNKNOWN_LIMIT_TTL_S = 5.0

def kafka_headers(row: OutboxRow) -> list[tuple[str, bytes]]:
    """The envelope's headers as Kafka headers, plus the message id and type."""
    return row.record_headers


def publish_span(row: OutboxRow) -> Any:
    """A started PRODUCER span for sending *row*: the child of the context its emit recorded.

    Only call it when tracing is on (:func:`outbox.runtime.tracing.enabled`); end it with
    :func:`outbox.runtime.tracing.finish` once Kafka answered.
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
            "outboxkit.run_id": row.headers.get(HEADER_RUN_ID),
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
    if isinstance(exc, KafkaClientError):
        return str(exc)[:2000]  # it starts with the client's own name for the error
    return f"{type(exc).__name__}: {exc}"[:2000]


def describe_briefly(exc: BaseException) -> str:
    """The first line of :func:`describe`: enough for a log line about an expected error.

    A dropped PostgreSQL connection's message runs over several lines (the server's hint,
    SQLAlchemy's link); none of them helps an operator more than the first.
    """
    return describe(exc).splitlines()[0] if str(exc) else type(exc).__name__


class Publisher:
    """One idempotent producer (acks=all) plus the admin client that checks topics, of the
    Kafka client chosen by ``kafka_client`` (:mod:`outbox.kafka`)."""

    @staticmethod
    def options_for(settings: RelaySettings) -> ProducerOptions:
        """The producer's options from the relay's settings."""
        return ProducerOptions(
            client_id=f"outboxkit-relay-{settings.relay_id}",
            linger_ms=settings.resolved_linger_ms(),
            batch_bytes=settings.producer_batch_bytes,
            compression=settings.compression,
            max_request_bytes=settings.max_request_bytes,
            delivery_timeout_ms=settings.delivery_timeout_ms,
            request_timeout_ms=settings.request_timeout_ms,
        )

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self._backend = settings.kafka()
        self._options = self.options_for(settings)
        self.producer: Producer = self._backend.producer(self._options)
        self._admin: Admin | None = None
        self._admin_lock = threading.Lock()
        self._known_topics: set[str] = set()
        self._ahead: threading.Thread | None = None
        # topic -> (its max.message.bytes, or None when unknown; when it was read)
        self._limits: dict[str, tuple[int | None, float]] = {}

    @property
    def client(self) -> str:
        return self._backend.name

    def reset(self) -> None:
        """Replace the producer: after a refused batch the idempotent producer can be left in
        a fatal state in which it fails every later send."""
        # Whatever it still held is unacknowledged, so still pending in the outbox.
        self.producer.close(timeout_s=0)
        self.producer = self._backend.producer(self._options)

    def close(self, timeout_s: float = 10.0) -> None:
        # Unacknowledged records stay pending in the outbox: the next relay sends them.
        self.producer.close(timeout_s=timeout_s)
        if self._ahead is not None:  # stopped while the admin client was being made
            self._ahead.join(timeout=timeout_s)
        with self._admin_lock:
            if self._admin is not None:
                self._admin.close()

    def _admin_client(self) -> Admin:
        with self._admin_lock:
            if self._admin is None:
                self._admin = self._backend.admin(
                    f"outboxkit-relay-admin-{self.settings.relay_id}")
            return self._admin

    def admin_ahead(self) -> None:
        """Make the admin client on a thread while the relay does its first claim (it
        connects to the cluster as it is made): the first batch's question about its topics
        then finds it ready."""
        self._ahead = threading.Thread(target=self._make_admin, name="relay-admin", daemon=True)
        self._ahead.start()

    def _make_admin(self) -> None:
        try:
            self._admin_client()
        except Exception as exc:  # missing_topics makes it again, and reports it
            log.debug("making the admin client ahead failed: %s", describe_briefly(exc))

    def _made(self) -> None:
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None

    def missing_topics(self, topics: Iterable[str]) -> dict[str, str]:
        """Topics that do not exist and could not be created, with the reason for each."""
        self._made()
        unknown = set(topics) - self._known_topics
        if not unknown:
            return {}
        admin = self._admin_client()
        # Only these topics: listing the cluster's (110 ms at 2,043 topics here) was paid at
        # every start and every new topic.
        existing = admin.existing_topics(unknown)
        self._known_topics |= existing
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
                admin.create_topic(
                    topic, self.settings.topic_partitions, self.settings.topic_replication
                )
                log.info("created topic %s", topic, extra={"event": "relay.topic_created"})
            except TopicExists:
                pass
            except TopicInvalid as exc:
                problems[topic] = f"topic {topic!r} cannot be created: {describe(exc)}"
                continue
            self._known_topics.add(topic)
        created = set(missing) - set(problems)
        self._wait_for_metadata(created)
        for topic in sorted(created):
            self._check_replication(admin, topic)
        return problems

    def size_limits(self, topics: Iterable[str]) -> dict[str, int]:
        """Each topic's max.message.bytes (the broker's refusal limit for a record batch),
        where known. Read once a minute per topic (every 5 s while it cannot be read); an
        unknown limit means none is applied (its records are sent together, as before)."""
        now = time.monotonic()
        stale = {t for t in topics if self._stale(t, now)}
        if stale:
            self._read_limits(stale, now)
        return {t: limit for t in topics if (limit := self._limits[t][0]) is not None}

    def _stale(self, topic: str, now: float) -> bool:
        if topic not in self._limits:
            return True
        limit, read_at = self._limits[topic]
        return now - read_at >= (TOPIC_LIMIT_TTL_S if limit is not None else UNKNOWN_LIMIT_TTL_S)

    def _read_limits(self, topics: set[str], now: float) -> None:
        try:
            configs = self._admin_client().topic_configs(topics, ["max.message.bytes"])
        except KafkaClientError as exc:
            log.debug("could not read the size limits of %s: %s", sorted(topics),
                      describe_briefly(exc))
            configs = {}
        for topic in topics:
            value = (configs.get(topic) or {}).get("max.message.bytes")
            limit = int(value) if value is not None and value.isdigit() else None
            if limit is not None and self._limits.get(topic, (None, 0.0))[0] != limit:
                warning = small_limit_warning(topic, limit, self.settings.producer_batch_bytes)
                if warning:
                    log.warning(warning, extra={"event": "relay.topic_limit_small"})
            self._limits[topic] = (limit, now)

    def forget_limit(self, topic: str) -> None:
        """Read *topic*'s limit again before its next batch (the broker refused a record)."""
        self._limits.pop(topic, None)

    def _check_replication(self, admin: Admin, topic: str) -> None:
        """Say so when a topic the relay created has fewer replicas than the cluster allows:
        Apache Kafka's default.replication.factor is 1, and the relay asks for the default."""
        # The node asked may learn of the new topic a moment after the one that created it:
        # 0 replicas means "not known here yet", not "fine".
        deadline = time.monotonic() + 5
        while True:
            try:
                replicas, brokers = admin.replication(topic)
            except KafkaClientError as exc:  # advisory: the topic is there and works
                log.debug("could not read the replication of %s: %s", topic, describe(exc))
                return
            if replicas or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if under_replicated(replicas, brokers):
            log.warning(
                "topic %s was created with %d replica(s) on a cluster of %d brokers: one "
                "broker's loss can lose its messages. Set default.replication.factor=3 and "
                "min.insync.replicas=2 on the brokers (or OUTBOXKIT_RELAY_TOPIC_REPLICATION), "
                "then reassign this topic's replicas",
                topic, replicas, brokers, extra={"event": "relay.topic_under_replicated"},
            )

    def _wait_for_metadata(self, topics: set[str]) -> None:
        """Wait until the producer knows each new topic and every partition's leader serves it.

        The broker's metadata names a partition's leader before that broker has taken the
        partition on, and a produce sent in between is refused (NotLeaderForPartition).
        The producer retries it, but librdkafka's idempotent producer may have sent the
        partition's next batch meanwhile: the broker accepts that one, and the client then
        reports the refused records delivered, without an offset, although they were never
        written (:func:`outbox.kafka.api.no_offset`, seen here in about one topic creation
        in twenty under load). Only a partition's leader answers a ListOffsets request, so
        the first batch waits until each partition answered one (at most 10 s).
        """
        deadline = time.monotonic() + 10
        for topic in sorted(topics):
            partitions: set[int] | None = None
            while time.monotonic() < deadline:
                partitions = self.producer.partitions_for(topic)
                if partitions:
                    break
                time.sleep(0.05)
            if not partitions:
                continue
            self._wait_for_leaders(topic, partitions, deadline)

    def _wait_for_leaders(self, topic: str, partitions: set[int], deadline: float) -> None:
        while True:
            try:
                self._admin_client().end_offsets(
                    [TopicPartition(topic, p) for p in partitions],
                    timeout_s=max(0.1, deadline - time.monotonic()),
                )
                return
            except KafkaClientError as exc:
                if time.monotonic() >= deadline:
                    # Sent anyway: a record the client reports delivered without an offset
                    # is taken as not sent (no_offset), and sent again.
                    log.warning(
                        "the leaders of new topic %s did not all answer within 10 s: %s",
                        topic,
                        describe_briefly(exc),
                        extra={"event": "relay.topic_leaders_wait"},
                    )
                    return
            time.sleep(0.05)

    def send(
        self,
        rows: list[OutboxRow],
        on_wait: Callable[[float], None] | None = None,
    ) -> tuple[list[Published], list[Failed]]:
        """Send *rows*, wait for every acknowledgement, and sort the outcomes.

        *on_wait* is called about once a second with the seconds waited so far, so the
        daemon can report itself not ready while Kafka does not answer.
        """
        # One check per batch: without a configured tracer no per-message span work at all.
        if tracing.enabled():
            return self._send_traced(rows, on_wait)
        # Made as they are sent: at start-up the first record of a batch of 1,000 left
        # about 30 ms after the batch began, once every record had been made.
        outgoing = (Outgoing(r.topic, r.key, r.payload, r.record_headers) for r in rows)
        deliveries = self._deliver(outgoing, on_wait)
        if all(d.error is None for d in deliveries):  # the usual batch: one pass, no checks
            return [Published(r, d.partition, d.offset)
                    for r, d in zip(rows, deliveries, strict=True)], []
        published: list[Published] = []
        failed: list[Failed] = []
        for row, delivery in zip(rows, deliveries, strict=True):
            if delivery.error is None:
                published.append(Published(row, delivery.partition, delivery.offset))
            else:
                failed.append(self._failed(row, delivery.error, delivery.permanent))
        return published, failed

    def _failed(self, row: OutboxRow, error: BaseException, permanent: bool) -> Failed:
        if getattr(error, "code", None) == NO_OFFSET:
            # Sent again, as any transient failure; said loudly, since the broker may hold
            # later records of its key already (outbox.kafka.api.no_offset).
            log.error(
                "message %s (outbox row %s, topic %s, key %r) was reported delivered without "
                "an offset: not taken as published, it is sent again; if it was never "
                "written, it now comes after later messages of its key",
                row.message_id, row.id, row.topic, row.key,
                extra={"event": "relay.no_offset"},
            )
        if not permanent:
            # Maybe the topic is gone (deleted since it was listed: librdkafka says so only
            # as a timeout): the next batch of it asks the broker again, and creates it.
            self._known_topics.discard(row.topic)
        return Failed(row, describe(error), permanent)

    def _deliver(
        self, outgoing: Iterable[Outgoing], on_wait: Callable[[float], None] | None
    ) -> list[Delivery]:
        return self.producer.send(
            outgoing,
            timeout_s=self.settings.delivery_timeout_ms / 1000 + 5,
            on_wait=on_wait,
            handed_over=_after_send,
        )

    def _send_traced(
        self, rows: list[OutboxRow], on_wait: Callable[[float], None] | None
    ) -> tuple[list[Published], list[Failed]]:
        """:meth:`send` with a PRODUCER span per message, ended once Kafka answered."""
        spans = [publish_span(row) for row in rows]
        outgoing = [
            Outgoing(r.topic, r.key, r.payload, traced_headers(kafka_headers(r), span))
            for r, span in zip(rows, spans, strict=True)
        ]
        deliveries = self._deliver(outgoing, on_wait)
        published: list[Published] = []
        failed: list[Failed] = []
        for row, span, delivery in zip(rows, spans, deliveries, strict=True):
            if delivery.error is not None:
                failed.append(self._failed(row, delivery.error, delivery.permanent))
                tracing.finish(span, error=delivery.error)
                continue
            published.append(Published(row, delivery.partition, delivery.offset))
            tracing.set_attributes(
                span,
                {
                    "messaging.destination.partition.id": str(delivery.partition),
                    "messaging.kafka.offset": delivery.offset,
                },
            )
            tracing.finish(span)
        return published, failed

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
            [delivery] = self.producer.send(
                [Outgoing(topic, row.key, value, headers)],
                timeout_s=self.settings.delivery_timeout_ms / 1000,
            )
            if delivery.error is None:
                return Failed(row, failure.error, True, delivery.partition, delivery.offset)
            self.reset()  # a refused batch can leave the idempotent producer failing
            if delivery.too_large:
                continue
            if not delivery.permanent:
                # The copy was not acknowledged (a broker down, a timeout): not a reason to
                # give up on it. The row stays where it is, as a transient failure, and is
                # sent (and refused, and copied) again.
                return Failed(
                    row,
                    f"its dead-letter copy to {topic} was not acknowledged: "
                    f"{describe_briefly(delivery.error)}",
                    False,
                )
            log.warning(
                "dead-lettering message %s failed: %s",
                row.message_id,
                describe_briefly(delivery.error),
                extra={"event": "relay.dead_letter_failed"},
            )
            return failure
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


def _after_send() -> None:
    failpoint("relay.after_send")


def under_replicated(replicas: int, brokers: int) -> bool:
    """Fewer replicas than the cluster could give, up to the recommended 3."""
    return 0 < replicas < min(3, brokers)
