"""The confluent-kafka consumer behind :class:`outbox.kafka.api.Consumer`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NoReturn, cast

from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
)
from confluent_kafka import TopicPartition as KafkaTopicPartition

from outbox.kafka.api import (
    CommitCallback,
    Connection,
    ConsumerOptions,
    Headers,
    KafkaClientError,
    RebalanceListener,
    Record,
    TopicPartition,
    UnreadableRecord,
)
from outbox.kafka.confluent.librdkafka import (
    CONSUMER_FATAL_CODES,
    UNREADABLE_CODES,
    as_error,
    client_config,
    kafka_tp,
    serious,
    topic_partitions,
    translated,
)

log = logging.getLogger(__name__)

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
            # socket.timeout.ms stays librdkafka's 60 s, unlike the producer's: at 10 s, a group
            # coordinator request timed out during a broker outage and, once in ~10 outages
            # of 7-22 s, the consumer never rejoined after the broker came back (its request
            # to the coordinator timed out again every 11 s, for minutes). See
            # docs/operations.md, "Kafka clients".
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
        # The assignment as the rebalance callbacks left it. librdkafka's own answer is a
        # request to its group thread, waited for: under load 0.44 ms a call on average, up
        # to 5 ms (measured 2026-12-06), and the runner's loop asks once per poll.
        self._assigned: set[TopicPartition] = set()
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
        consumer.assign([kafka_tp(tp, starts.get(tp, OFFSET_INVALID)) for tp in tps])
        self._assigned.update(tps)
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
        # Revoked or lost: librdkafka unassigns them once the callback returns.
        self._assigned.difference_update(tps)
        paused = [tp for tp in tps if tp in self._paused]
        if paused:
            # A partition assigned again starts unpaused, as the set will say.
            with contextlib.suppress(KafkaException):
                self._consumer.resume([kafka_tp(tp) for tp in paused])
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
            raise as_error(trouble)
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
            self._unreadable(as_error(err, UnreadableRecord), msg, messages, n, records)
        if err.fatal() or code in CONSUMER_FATAL_CODES:
            raise as_error(err)
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
        if serious(err):
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
                offsets=[kafka_tp(tp, o) for tp, o in offsets.items()], asynchronous=False
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
                offsets=[kafka_tp(tp, o) for tp, o in offsets.items()], asynchronous=True
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

    def unsubscribe(self) -> None:
        with contextlib.suppress(KafkaException):
            self._consumer.unsubscribe()

    def member_id(self) -> str | None:
        try:
            return self._consumer.memberid() or None
        except (KafkaException, RuntimeError):
            return None

    # positions
    def pause(self, *partitions: TopicPartition) -> None:
        if partitions:
            self._consumer.pause([kafka_tp(tp) for tp in partitions])
            self._paused.update(TopicPartition(*tp) for tp in partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        if partitions:
            self._consumer.resume([kafka_tp(tp) for tp in partitions])
            self._paused.difference_update(TopicPartition(*tp) for tp in partitions)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def seek(self, partition: TopicPartition, offset: int) -> None:
        tp = TopicPartition(*partition)
        if self._assigning is not None:
            self._assigning[tp] = offset  # inside assigned(): the assignment starts there
            return
        try:
            self._consumer.seek(kafka_tp(tp, offset))
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or err.code() != KafkaError._STATE:
                raise translated(exc) from exc
            # Assigned but not fetching yet: librdkafka refuses; the next poll tries again.
            self._retry_seek[tp] = offset
        self._sought[tp] = offset

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def position(self, partition: TopicPartition) -> int | None:
        tp = TopicPartition(*partition)
        try:
            found = self._consumer.position([kafka_tp(tp)])[0].offset
        except KafkaException:
            found = OFFSET_INVALID
        if found >= 0:
            return int(found)
        return self._sought.get(tp)  # after a seek, before a record is read from there

    def highwater(self, partition: TopicPartition) -> int | None:
        ctp = kafka_tp(partition)
        try:
            high = self._consumer.get_watermark_offsets(ctp, cached=True)[1]
            if high < 0:  # nothing fetched from it yet: ask its leader
                high = self._consumer.get_watermark_offsets(ctp, timeout=1.0, cached=False)[1]
        except KafkaException:
            return None
        return None if high < 0 else int(high)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return topic_partitions(self._consumer, topic, 10.0)

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
