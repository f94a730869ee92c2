"""The confluent-kafka (librdkafka) backend of :mod:`outbox.kafka.api`.

``pip install 'outboxkit[confluent]'``. librdkafka sends and fetches in C threads: the
Python left per record is one ``produce`` call and its delivery callback, or one message
turned into a :class:`~outbox.kafka.api.Record`. Keys go to the partitions kafka-python and
the Java client choose (murmur2), so switching backends keeps every key in its partition.

librdkafka's log lines go to the ``outbox.kafka.confluent`` logger (the application decides
where they end up; nothing here configures logging).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
)
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined] # re-exported, not in __all__
    AdminClient,
    ConfigResource,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from outbox.kafka.api import (
    ClientName,
    CommitCallback,
    CommitRefused,
    Connection,
    ConsumerOptions,
    Delivery,
    Headers,
    KafkaClientError,
    Outgoing,
    ProducerOptions,
    RebalanceListener,
    Record,
    TopicExists,
    TopicInvalid,
    TopicPartition,
    UnreadableRecord,
)

log = logging.getLogger(__name__)

LATEST: Any = OffsetSpec.latest()  # type: ignore[no-untyped-call] # untyped upstream

# librdkafka backs reconnects off up to 10 s by default: every 2 s at most recovers promptly
# after a broker restart (the same bound as the kafka-python backend).
RECONNECT_BACKOFF_MAX_MS = 2000

# The refusals kafka_python.PERMANENT_ERRORS lists, by librdkafka's codes: trying again
# cannot change the answer. Anything else is transient.
PERMANENT_CODES = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,  # also what produce() raises for a record over the limit
    KafkaError.TOPIC_EXCEPTION,  # invalid topic
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.INVALID_RECORD,
    KafkaError.INVALID_MSG,  # the broker's CORRUPT_MESSAGE
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT,
})
TOO_LARGE_CODES = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})

# A commit the group refused because it rebalanced (another member owns the partition now).
REBALANCED_CODES = frozenset({
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.FENCED_INSTANCE_ID,
    KafkaError.STALE_MEMBER_EPOCH,
    KafkaError.FENCED_MEMBER_EPOCH,
    KafkaError._ASSIGNMENT_LOST,
    KafkaError._NO_OFFSET,  # nothing of ours left to commit: the partitions were taken
})

# A consumed "message" that is an error about one record: it cannot be read.
UNREADABLE_CODES = frozenset({
    KafkaError._BAD_MSG, KafkaError._BAD_COMPRESSION, KafkaError.INVALID_MSG,
})
# Consumer errors that no retry mends: raised from poll, as kafka-python does.
CONSUMER_FATAL_CODES = frozenset({
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._AUTHENTICATION,
})

WAIT_STEP_S = 1.0  # how often send() reports a long wait (on_wait)
QUEUE_FULL_PAUSE_S = 0.05  # librdkafka's local queue is full: let deliveries drain


def client_config(connection: Connection) -> dict[str, Any]:
    """librdkafka settings every client of *connection* shares: the bootstrap servers and
    the TLS/SASL settings. Only what the protocol uses is passed, so PLAINTEXT stays plain."""
    protocol = connection.security_protocol
    config: dict[str, Any] = {
        "bootstrap.servers": ",".join(connection.servers),
        "security.protocol": protocol,
        "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS,
        "logger": log,
    }
    if protocol in ("SSL", "SASL_SSL"):
        for name, value in (
            ("ssl.ca.location", connection.ssl_cafile),
            ("ssl.certificate.location", connection.ssl_certfile),
            ("ssl.key.location", connection.ssl_keyfile),
        ):
            if value:
                config[name] = value
        config["ssl.endpoint.identification.algorithm"] = (
            "https" if connection.ssl_check_hostname else "none"
        )
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        config.update({
            "sasl.mechanism": connection.sasl_mechanism or "PLAIN",
            "sasl.username": connection.sasl_username,
            "sasl.password": connection.sasl_password,
        })
    return config


def _serious(err: KafkaError) -> bool:
    return err.fatal() or err.code() in CONSUMER_FATAL_CODES


def _error(err: KafkaError, kind: type[KafkaClientError] = KafkaClientError) -> KafkaClientError:
    """librdkafka's error as the interface's: its text starts with the error's name (what
    operators search for), ``code`` is the name, the original is the cause."""
    error = kind(f"{err.name()}: {err.str()}", code=err.name())
    error.__cause__ = KafkaException(err)
    return error


def translated(exc: KafkaException) -> KafkaClientError:
    """confluent-kafka's exception as the interface's (admin and consumer calls)."""
    err = exc.args[0] if exc.args else None
    if not isinstance(err, KafkaError):
        error = KafkaClientError(str(exc), code=type(exc).__name__)
        error.__cause__ = exc
        return error
    code = err.code()
    kind: type[KafkaClientError] = KafkaClientError
    if code == KafkaError.TOPIC_ALREADY_EXISTS:
        kind = TopicExists
    elif code in (KafkaError.TOPIC_EXCEPTION, KafkaError.POLICY_VIOLATION):
        kind = TopicInvalid
    elif code in REBALANCED_CODES:
        kind = CommitRefused
    error = _error(err, kind)
    error.__cause__ = exc
    return error


def _ctp(tp: tuple[str, int], offset: int | None = None) -> KafkaTopicPartition:
    if offset is None:
        return KafkaTopicPartition(tp[0], tp[1])
    return KafkaTopicPartition(tp[0], tp[1], offset)


class ConfluentBackend:
    name: ClientName = "confluent"

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def producer(self, options: ProducerOptions) -> ConfluentProducer:
        return ConfluentProducer(self.connection, options)

    def consumer(self, options: ConsumerOptions) -> ConfluentConsumer:
        return ConfluentConsumer(self.connection, options)

    def admin(self, client_id: str, request_timeout_ms: int = 15_000) -> ConfluentAdmin:
        return ConfluentAdmin(self.connection, client_id, request_timeout_ms)


# --- producer ----------------------------------------------------------------------------
@dataclass(slots=True)
class _Answer(Delivery):
    """A Delivery that is its own delivery callback: no closure per record on the hot path."""

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if self.error is not None:
            return  # answered already (given up on at the timeout): the caller has it
        if err is None:
            self.partition, self.offset = msg.partition() or 0, msg.offset() or 0
        else:
            _refused(self, err)


def _refused(delivery: Delivery, err: KafkaError) -> None:
    delivery.error = _error(err)
    code = err.code()
    # An idempotent producer's fatal error (a sequence gap, a fenced id) is not about the
    # record: the relay replaces the producer and sends it again.
    delivery.permanent = code in PERMANENT_CODES and not err.fatal()
    delivery.too_large = code in TOO_LARGE_CODES


class ConfluentProducer:
    def __init__(self, connection: Connection, options: ProducerOptions) -> None:
        self.options = options
        config = client_config(connection)
        config.update({
            "client.id": options.client_id,
            "enable.idempotence": True,
            "acks": "all",
            # ≤ 5 keeps the idempotent producer's per-partition ordering guarantee.
            "max.in.flight.requests.per.connection": 5,
            "linger.ms": options.linger_ms,
            "batch.size": options.batch_bytes,
            "compression.type": options.compression,
            "message.max.bytes": options.max_request_bytes,
            "delivery.timeout.ms": options.delivery_timeout_ms,
            "request.timeout.ms": min(
                30_000, max(1, options.delivery_timeout_ms - options.linger_ms)
            ),
            "allow.auto.create.topics": False,
            # librdkafka's default (consistent_random, CRC32) puts keys elsewhere than
            # kafka-python and the Java client; murmur2 keeps every key where they put it.
            "partitioner": "murmur2_random",
            "error_cb": self._on_error,
        })
        # The client's last error of its own (a refused password, brokers unreachable): it
        # explains a record that got no answer in time.
        self._trouble: KafkaError | None = None
        try:
            self._producer = Producer(config)
        except KafkaException as exc:
            raise ValueError(f"invalid Kafka producer setting: {exc}") from exc

    def send(
        self,
        records: Sequence[Outgoing],
        *,
        timeout_s: float,
        on_wait: Callable[[float], None] | None = None,
        handed_over: Callable[[], None] | None = None,
    ) -> list[Delivery]:
        started = time.monotonic()
        deadline = started + timeout_s
        self._trouble = None
        results: list[Delivery] = []
        append = results.append
        produce, poll = self._producer.produce, self._producer.poll
        for topic, key, value, headers in records:
            answer = _Answer()
            append(answer)
            try:
                produce(topic, value, key, on_delivery=answer, headers=headers or None)  # type: ignore[arg-type]
            except BufferError:
                self._produce_when_room(answer, (topic, key, value, headers), deadline)
            except KafkaException as exc:
                _refused(answer, exc.args[0])
            except (TypeError, ValueError) as exc:
                answer.error, answer.permanent = exc, True
        if handed_over is not None:
            handed_over()
        poll(0)  # serve the answers that are in already
        self._await(results, started, deadline, on_wait)
        return results

    def _produce_when_room(
        self, answer: _Answer, record: tuple[str, bytes | None, bytes | None, Headers],
        deadline: float,
    ) -> None:
        """librdkafka's local queue is full: serve deliveries until there is room (at most
        max_block_ms, as kafka-python blocks in send; or until the send's deadline)."""
        topic, key, value, headers = record
        give_up = min(deadline, time.monotonic() + self.options.max_block_ms / 1000)
        while True:
            self._producer.poll(QUEUE_FULL_PAUSE_S)
            try:
                self._producer.produce(topic, value, key, on_delivery=answer,
                                       headers=headers or None)  # type: ignore[arg-type]
            except BufferError:
                if time.monotonic() >= give_up:
                    answer.error = KafkaClientError(
                        "_QUEUE_FULL: the local queue stayed full (the broker is slow or "
                        "away); sent again later", code="_QUEUE_FULL",
                    )
                    return
            except KafkaException as exc:
                _refused(answer, exc.args[0])
                return
            else:
                return

    def _await(
        self, results: list[Delivery], started: float, deadline: float,
        on_wait: Callable[[float], None] | None,
    ) -> None:
        flush = self._producer.flush
        while True:
            left = deadline - time.monotonic()
            # flush() returns 0 once every queued record is answered and its callback run.
            if left <= 0 or flush(min(WAIT_STEP_S, left)) == 0:
                break
            # Records of an earlier send that timed out may still be queued: ours may be in.
            if all(d.error is not None or d.offset >= 0 for d in results):
                break
            if on_wait is not None:
                on_wait(time.monotonic() - started)
        unanswered = [d for d in results if d.error is None and d.offset < 0]
        if unanswered:
            text = "_MSG_TIMED_OUT: no acknowledgement in time"
            if self._trouble is not None:
                text += f" (the client: {self._trouble.name()}: {self._trouble.str()})"
            for delivery in unanswered:
                delivery.error = KafkaClientError(text, code="_MSG_TIMED_OUT")

    def _on_error(self, err: KafkaError) -> None:
        # A refused password says more than the "all brokers down" that follows it.
        if self._trouble is None or not _serious(self._trouble) or _serious(err):
            self._trouble = err

    def partitions_for(self, topic: str) -> set[int] | None:
        try:
            found = self._producer.list_topics(topic, timeout=self.options.max_block_ms / 1000)
        except KafkaException:
            return None
        meta = found.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return None
        return set(meta.partitions)

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(Exception):
            if self._producer.flush(timeout_s) > 0:
                # What is still queued is given up (kafka-python drops it the same way).
                self._producer.purge()
                self._producer.poll(0)


# --- consumer ----------------------------------------------------------------------------
class ConfluentConsumer:
    def __init__(self, connection: Connection, options: ConsumerOptions) -> None:
        config = client_config(connection)
        config.update({
            "group.id": options.group_id,
            "client.id": options.client_id,
            # outboxkit commits itself, after the database commit.
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": options.auto_offset_reset,
            "session.timeout.ms": options.session_timeout_ms,
            "heartbeat.interval.ms": max(100, options.session_timeout_ms // 3),
            "max.poll.interval.ms": options.max_poll_interval_ms,
            # New topics and partition changes are noticed within seconds, not minutes.
            "topic.metadata.refresh.interval.ms": options.metadata_max_age_ms,
            # kafka-python checks every record's CRC; librdkafka does only when asked.
            "check.crcs": True,
            "on_commit": self._on_commit,
            "error_cb": self._on_error,
        })
        config.update(options.extra)
        try:
            self._consumer = Consumer(config)
        except KafkaException as exc:
            raise ValueError(f"invalid Kafka consumer setting: {exc}") from exc
        self._listener: RebalanceListener | None = None
        # librdkafka does not list paused partitions, nor say where a seek went before a
        # record is read from there: both are kept here (forgotten when a partition goes).
        self._paused: set[TopicPartition] = set()
        self._sought: dict[TopicPartition, int] = {}
        self._retry_seek: dict[TopicPartition, int] = {}
        # Seeks asked for while partitions are being assigned: they become the assignment's
        # starting offsets (a seek is refused before the partition is fetching).
        self._assigning: dict[TopicPartition, int] | None = None
        self._async: list[tuple[dict[TopicPartition, int], CommitCallback]] = []
        self._closing = False
        self._trouble: KafkaError | None = None  # an error no retry mends, raised by poll

    # rebalances: librdkafka calls these inside consume(), on the polling thread.
    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None:
        self._listener = listener
        self._consumer.subscribe(
            list(topics), on_assign=self._on_assign, on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )

    def _on_assign(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self._assigning = {}
        try:
            if self._listener is not None:
                self._listener.assigned(tps)
            starts = self._assigning
        finally:
            self._assigning = None
        consumer.assign([_ctp(tp, starts.get(tp, OFFSET_INVALID)) for tp in tps])
        self._sought.update(starts)

    def _on_revoke(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        # Also called inside close(): kafka-python's close tells the listener too, and
        # to_commit() only ever names offsets safe to commit (handled and in the database).
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        committed: dict[TopicPartition, int] = {}
        error: BaseException | None = None
        listener = self._listener
        offsets = dict(listener.to_commit(tps)) if listener is not None else {}
        if offsets:
            try:
                self._commit(offsets)
                committed = offsets
            except KafkaClientError as exc:
                error = exc
        self._forget(tps)
        if listener is not None:
            listener.revoked(tps, committed, error)

    def _on_lost(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self._forget(tps)
        if self._listener is not None and not self._closing:
            self._listener.lost(tps)

    def _forget(self, tps: Collection[TopicPartition]) -> None:
        paused = [tp for tp in tps if tp in self._paused]
        if paused:
            # A partition assigned again starts unpaused, as the set will say.
            with contextlib.suppress(KafkaException):
                self._consumer.resume([_ctp(tp) for tp in paused])
        for tp in tps:
            self._paused.discard(tp)
            self._sought.pop(tp, None)
            self._retry_seek.pop(tp, None)

    # reading
    def poll(self, timeout_ms: int, max_records: int) -> list[Any]:
        if self._retry_seek:
            self._seek_again()
        consume = self._consumer.consume
        # consume(n, timeout) waits until it has n messages or the timeout: ask for what is
        # there first, and wait for one only when nothing is, as kafka-python's poll does.
        messages = consume(max_records, 0)
        if not messages and timeout_ms > 0:
            messages = consume(1, timeout_ms / 1000)
            if messages and max_records > 1:
                messages += consume(max_records - 1, 0)
        if self._trouble is not None:
            trouble, self._trouble = self._trouble, None
            raise _error(trouble)
        try:
            return self._records(messages)
        except _Handover as handover:
            return handover.records

    def _records(self, messages: list[Message]) -> list[Any]:
        records: list[Any] = []
        append = records.append
        for n, msg in enumerate(messages):
            err = msg.error()
            if err is not None:
                self._message_error(err, msg, messages, n, records)
                continue
            try:
                append(Record(msg.topic(), msg.partition(), msg.offset(),  # type: ignore[arg-type]
                              msg.timestamp()[1], msg.key(), msg.value(),
                              cast(Headers, msg.headers() or [])))
            except (UnicodeDecodeError, SystemError) as exc:
                # A header name that is not UTF-8: the record cannot be handed over as it is.
                # confluent-kafka 2.16 raises SystemError for it (its C code returns the
                # headers with the decoding error still set), or returns and leaves the error
                # set for the next call (here: making the Record) to trip over.
                _clear_leaked_error()
                cause = exc.__cause__ or exc
                self._unreadable(KafkaClientError(
                    f"_BAD_MSG: a header name is not UTF-8 ({cause})", code="_BAD_MSG"),
                    msg, messages, n, records)
        if self._sought and records:
            for record in records:  # librdkafka knows the position again once it reads
                self._sought.pop(TopicPartition(record.topic, record.partition), None)
        return records

    def _message_error(
        self, err: KafkaError, msg: Message, messages: list[Message], n: int,
        records: list[Any],
    ) -> None:
        """Skip an error that is not a record; raise when it is about a record (see
        _unreadable) or when no retry mends it."""
        code = err.code()
        if code in UNREADABLE_CODES and msg.offset() is not None and msg.offset() >= 0:  # type: ignore[operator]
            self._unreadable(_error(err, UnreadableRecord), msg, messages, n, records)
        if err.fatal() or code in CONSUMER_FATAL_CODES:
            raise _error(err)
        # End of a partition, a broker unreachable for a while, a topic not there yet:
        # librdkafka retries on its own; these are not records.
        log.debug("Kafka consumer: %s: %s", err.name(), err.str())

    def _unreadable(
        self, error: KafkaClientError, msg: Message, messages: list[Message], n: int,
        records: list[Any],
    ) -> NoReturn:
        """Report the record at messages[n] as unreadable, without losing the others: the
        records before it are handed over first; every partition of the rest is sought back
        to its first message there, so the next poll reads them (and this one) again."""
        again: dict[TopicPartition, int] = {}
        for later in messages[n:]:
            offset = later.offset()
            if offset is not None and offset >= 0:
                again.setdefault(TopicPartition(later.topic(), later.partition()), offset)  # type: ignore[arg-type]
        for tp, offset in again.items():
            self.seek(tp, offset)
        if records:
            raise _Handover(records)
        tp = TopicPartition(msg.topic(), msg.partition())  # type: ignore[arg-type]
        unreadable = UnreadableRecord(str(error), code=error.code, partition=tp,
                                      offset=msg.offset())
        unreadable.__cause__ = error.__cause__ or error
        raise unreadable

    def _on_error(self, err: KafkaError) -> None:
        """librdkafka's errors of the client itself (served inside consume()). Most mend
        on their own (a broker away for a while); a refused password or a fatal error is
        raised by the next poll, as kafka-python raises it."""
        if _serious(err):
            self._trouble = err
        else:
            log.debug("Kafka consumer: %s: %s", err.name(), err.str())

    def _seek_again(self) -> None:
        retry, self._retry_seek = self._retry_seek, {}
        for tp, offset in retry.items():
            self.seek(tp, offset)

    # offsets
    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        if offsets:
            self._commit(offsets)

    def _commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        try:
            answered = self._consumer.commit(
                offsets=[_ctp(tp, o) for tp, o in offsets.items()], asynchronous=False
            )
        except KafkaException as exc:
            raise translated(exc) from exc
        for part in answered or ():
            if part.error is not None:
                raise translated(KafkaException(part.error))

    def commit_async(self, offsets: Mapping[TopicPartition, int], callback: CommitCallback) -> None:
        if not offsets:
            callback(offsets, None)
            return
        pending = (dict(offsets), callback)
        self._async.append(pending)
        try:
            self._consumer.commit(
                offsets=[_ctp(tp, o) for tp, o in offsets.items()], asynchronous=True
            )
        except KafkaException as exc:
            self._async.remove(pending)
            callback(offsets, translated(exc))

    def _on_commit(self, err: KafkaError | None, partitions: list[KafkaTopicPartition]) -> None:
        """librdkafka's answer to an asynchronous commit (served inside consume()). It does
        not say which commit it answers: they are answered in order, matched by content."""
        answered = {TopicPartition(p.topic, p.partition): p.offset for p in partitions}
        for n, pending in enumerate(self._async):
            offsets = pending[0]
            if offsets == answered or (err is not None and offsets.keys() == answered.keys()):
                del self._async[n]
                break
        else:
            return  # not one of ours
        offsets, callback = pending
        failed = err if err is not None else next(
            (p.error for p in partitions if p.error is not None), None
        )
        callback(offsets, None if failed is None else translated(KafkaException(failed)))

    # positions
    def pause(self, *partitions: TopicPartition) -> None:
        if partitions:
            self._consumer.pause([_ctp(tp) for tp in partitions])
            self._paused.update(TopicPartition(*tp) for tp in partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        if partitions:
            self._consumer.resume([_ctp(tp) for tp in partitions])
            self._paused.difference_update(TopicPartition(*tp) for tp in partitions)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def seek(self, partition: TopicPartition, offset: int) -> None:
        tp = TopicPartition(*partition)
        if self._assigning is not None:
            self._assigning[tp] = offset  # inside assigned(): the assignment starts there
            return
        try:
            self._consumer.seek(_ctp(tp, offset))
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or err.code() != KafkaError._STATE:
                raise translated(exc) from exc
            # Assigned but not fetching yet: librdkafka refuses; the next poll tries again.
            self._retry_seek[tp] = offset
        self._sought[tp] = offset

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(p.topic, p.partition) for p in self._consumer.assignment()}

    def position(self, partition: TopicPartition) -> int | None:
        tp = TopicPartition(*partition)
        try:
            found = self._consumer.position([_ctp(tp)])[0].offset
        except KafkaException:
            found = OFFSET_INVALID
        if found >= 0:
            return int(found)
        return self._sought.get(tp)  # after a seek, before a record is read from there

    def highwater(self, partition: TopicPartition) -> int | None:
        ctp = _ctp(partition)
        try:
            high = self._consumer.get_watermark_offsets(ctp, cached=True)[1]
            if high < 0:  # nothing fetched from it yet: ask its leader
                high = self._consumer.get_watermark_offsets(ctp, timeout=1.0, cached=False)[1]
        except KafkaException:
            return None
        return None if high < 0 else int(high)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        try:
            found = self._consumer.list_topics(topic, timeout=10.0)
        except KafkaException:
            return None
        meta = found.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return None
        return set(meta.partitions)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(Exception):
            self._consumer.close()


def _nothing() -> None:
    return None


def _clear_leaked_error() -> None:
    """Raise and drop an error confluent-kafka's C code left set after a failed call, here
    rather than at some unrelated line of the caller (seen: at the next name lookup)."""
    for _ in range(5):
        try:
            _nothing()
        except (UnicodeDecodeError, SystemError):
            continue
        return


class _Handover(Exception):
    """Control flow inside poll (records to hand over before an unreadable one)."""

    def __init__(self, records: list[Any]) -> None:
        super().__init__()
        self.records = records


# --- admin -------------------------------------------------------------------------------
class ConfluentAdmin:
    def __init__(self, connection: Connection, client_id: str, request_timeout_ms: int) -> None:
        config = client_config(connection)
        config["client.id"] = client_id
        config["error_cb"] = self._on_error
        # The client's last error of its own (a refused password): a request that timed out
        # says why, as kafka-python's admin raises the refusal itself.
        self._trouble: KafkaError | None = None
        try:
            self._admin = AdminClient(config)
        except KafkaException as exc:
            raise translated(exc) from exc
        self._timeout_s = request_timeout_ms / 1000

    def _on_error(self, err: KafkaError) -> None:
        if self._trouble is None or not _serious(self._trouble) or _serious(err):
            self._trouble = err

    def _failed(self, exc: KafkaException) -> KafkaClientError:
        self._admin.poll(0)  # serve the client's own errors (error_cb)
        error = translated(exc)
        trouble = self._trouble
        if trouble is not None and trouble.name() != error.code:
            error = type(error)(f"{error} (the client: {trouble.name()}: {trouble.str()})",
                                code=error.code)
            error.__cause__ = exc
        return error

    def list_topics(self) -> set[str]:
        try:
            return set(self._admin.list_topics(timeout=self._timeout_s).topics)
        except KafkaException as exc:
            raise self._failed(exc) from exc

    def create_topic(self, name: str, partitions: int = -1, replication: int = -1) -> None:
        topic = NewTopic(name, num_partitions=partitions, replication_factor=replication)
        try:
            futures = self._admin.create_topics(
                [topic], operation_timeout=self._timeout_s, request_timeout=self._timeout_s
            )
            futures[name].result()
        except KafkaException as exc:
            raise translated(exc) from exc

    def topic_configs(
        self, topics: Collection[str], names: Collection[str]
    ) -> dict[str, dict[str, str] | None]:
        if not topics:
            return {}
        try:
            futures = self._admin.describe_configs(
                [ConfigResource(ResourceType.TOPIC, t) for t in sorted(topics)],
                request_timeout=self._timeout_s,
            )
        except KafkaException as exc:
            raise translated(exc) from exc
        result: dict[str, dict[str, str] | None] = {}
        for resource, future in futures.items():
            try:
                entries = future.result()  # every value, defaults included
            except KafkaException:
                result[resource.name] = None  # not there, or not ours to see
                continue
            values = {n: str(entries[n].value) for n in names if n in entries}
            result[resource.name] = values or None
        return result

    def end_offsets(
        self, partitions: Collection[TopicPartition], timeout_s: float = 15.0
    ) -> dict[TopicPartition, int]:
        if not partitions:
            return {}
        try:
            futures = self._admin.list_offsets(
                {_ctp(tp): LATEST for tp in partitions}, request_timeout=timeout_s
            )
            return {
                TopicPartition(tp.topic, tp.partition): int(future.result().offset)
                for tp, future in futures.items()
            }
        except KafkaException as exc:
            raise translated(exc) from exc

    def delete_topics(self, topics: Collection[str]) -> None:
        if not topics:
            return
        try:
            futures = self._admin.delete_topics(
                list(topics), operation_timeout=self._timeout_s, request_timeout=self._timeout_s
            )
            for future in futures.values():
                future.result()
        except KafkaException as exc:
            raise translated(exc) from exc

    def close(self) -> None:
        """Nothing to release: librdkafka's handle goes with the object."""
