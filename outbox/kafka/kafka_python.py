"""The kafka-python backend of :mod:`outbox.kafka.api` (the default client).

Pure Python, no compiled dependency. outboxkit patches five bugs of kafka-python 3.0 in
every process that makes one of these clients (:mod:`outbox.kafka.kafka_python_fixes`), and
refuses to start when a kafka-python release moved what it patches.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from kafka import (
    AsyncConsumerRebalanceListener,
    KafkaAdminClient,
    KafkaConsumer,
    KafkaProducer,
    OffsetAndMetadata,
    OffsetSpec,
)
from kafka import TopicPartition as KafkaTopicPartition
from kafka import errors as kafka_errors
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from outbox.errors import ConfigurationError
from outbox.kafka import kafka_python_fixes as kafka_fix
from outbox.kafka.api import (
    ClientName,
    CommitCallback,
    CommitRefused,
    Connection,
    ConsumerOptions,
    Delivery,
    KafkaClientError,
    Outgoing,
    ProducerOptions,
    RebalanceListener,
    TopicExists,
    TopicInvalid,
    TopicPartition,
    UnreadableRecord,
    group_state,
    no_offset,
)
from outbox.kafka.partitioner import CachedKeyPartitioner

log = logging.getLogger(__name__)

# kafka-python backs reconnects off up to 30 s: after a broker restart a daemon would sit
# idle that long. Every 2 s at most is cheap and recovers promptly.
RECONNECT_BACKOFF_MAX_MS = 2000

# Refusals that will not change by trying again: the message goes to the dead-letter topic
# (or blocks its key). Anything else is treated as transient.
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
TOO_LARGE: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
)


def client_config(connection: Connection) -> dict[str, Any]:
    """Keyword arguments for every kafka-python client of *connection*: the bootstrap
    servers and the TLS/SASL settings under kafka-python 3.0's names. Only what the protocol
    uses is passed, so PLAINTEXT clients stay plain."""
    # Every kafka-python client is configured here: the place that makes sure the fixes are
    # in (a refused password's error, above all, would otherwise be lost).
    kafka_fix.install()
    protocol = connection.security_protocol
    config: dict[str, Any] = {
        "bootstrap_servers": connection.servers,
        "security_protocol": protocol,
        "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
    }
    if protocol in ("SSL", "SASL_SSL"):
        config.update(
            ssl_cafile=connection.ssl_cafile or None,
            ssl_certfile=connection.ssl_certfile or None,
            ssl_keyfile=connection.ssl_keyfile or None,
            ssl_check_hostname=connection.ssl_check_hostname,
        )
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        # kafka-python names them sasl_plain_* for SCRAM too.
        config.update(
            sasl_mechanism=connection.sasl_mechanism,
            sasl_plain_username=connection.sasl_username,
            sasl_plain_password=connection.sasl_password,
        )
    return config


def translated(exc: BaseException) -> KafkaClientError:
    """kafka-python's error as the interface's, with the original as its cause."""
    kind: type[KafkaClientError] = KafkaClientError
    if isinstance(exc, kafka_errors.TopicAlreadyExistsError):
        kind = TopicExists
    elif isinstance(exc, kafka_errors.InvalidTopicError | kafka_errors.PolicyViolationError):
        kind = TopicInvalid
    elif isinstance(exc, kafka_errors.CommitFailedError):
        kind = CommitRefused
    elif isinstance(exc, kafka_errors.CorruptRecordError):
        kind = UnreadableRecord
    error = kind(f"{type(exc).__name__}: {exc}", code=type(exc).__name__)
    error.__cause__ = exc
    return error


class KafkaPythonBackend:
    name: ClientName = "kafka-python"

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def producer(self, options: ProducerOptions) -> KafkaPythonProducer:
        return KafkaPythonProducer(self.connection, options)

    def consumer(self, options: ConsumerOptions) -> KafkaPythonConsumer:
        return KafkaPythonConsumer(self.connection, options)

    def admin(self, client_id: str, request_timeout_ms: int = 15_000) -> KafkaPythonAdmin:
        return KafkaPythonAdmin(self.connection, client_id, request_timeout_ms)


class KafkaPythonProducer:
    def __init__(self, connection: Connection, options: ProducerOptions) -> None:
        compression = None if options.compression == "none" else options.compression
        self.options = options
        try:
            self._producer = KafkaProducer(
                **client_config(connection),
                client_id=options.client_id,
                acks="all",
                enable_idempotence=True,
                # Pipelines requests across partitions only: idempotent, kafka-python keeps one
                # batch of a partition in flight (checked below).
                max_in_flight_requests_per_connection=5,
                linger_ms=options.linger_ms,
                batch_size=options.batch_bytes,
                compression_type=compression,
                max_request_size=options.max_request_bytes,
                delivery_timeout_ms=options.delivery_timeout_ms,
                request_timeout_ms=options.request_timeout_in_delivery_ms,
                allow_auto_create_topics=False,
                max_block_ms=options.max_block_ms,
                partitioner=CachedKeyPartitioner(),
                # Its sensors (per record, per request, per batch) are read by nobody here:
                # recording them was a tenth of the relay's Python at light traffic.
                metrics_enabled=False,
            )
        except kafka_errors.KafkaConfigurationError as exc:
            raise ValueError(str(exc)) from exc
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        _check_one_batch_per_partition(self._producer)

    def send(
        self,
        records: Iterable[Outgoing],
        *,
        timeout_s: float,
        on_wait: Callable[[float], None] | None = None,
        handed_over: Callable[[], None] | None = None,
    ) -> list[Delivery]:
        results: list[Delivery] = []
        futures: list[tuple[Delivery, Any]] = []
        send = self._producer.send
        for topic, key, value, headers in records:
            delivery = Delivery()
            results.append(delivery)
            try:
                futures.append((delivery, send(topic, value=value, key=key, headers=headers)))
            except Exception as exc:
                _refused(delivery, exc)
        if handed_over is not None:
            handed_over()
        self._await([f for _, f in futures], timeout_s, on_wait)
        for delivery, future in futures:
            if not future.is_done:
                delivery.error = KafkaClientError(
                    "KafkaTimeoutError: no acknowledgement in time", code="KafkaTimeoutError"
                )
            elif future.failed():
                _refused(delivery, future.exception)
            elif (meta := future.value).offset >= 0:
                delivery.partition, delivery.offset = meta.partition, meta.offset
            else:
                delivery.error = no_offset()  # transient: sent again
        return results

    def _await(
        self, futures: list[Any], timeout_s: float, on_wait: Callable[[float], None] | None
    ) -> None:
        """Wait until every future is resolved (or *timeout_s* passed).

        The loop watches our own futures rather than trusting flush(): when the broker
        refuses a batch as too large, kafka-python splits it and flush() can return early.
        """
        started = time.monotonic()
        while not all(f.is_done for f in futures):
            waited = time.monotonic() - started
            if waited >= timeout_s:
                return
            try:
                self._producer.flush(timeout=min(1.0, max(0.01, timeout_s - waited)))
            except kafka_errors.KafkaError:
                time.sleep(0.01)  # a batch was split or is still in flight: look again
            if waited >= 1 and on_wait is not None:
                on_wait(waited)

    def partitions_for(self, topic: str) -> set[int] | None:
        try:
            found = self._producer.partitions_for(topic)
        except kafka_errors.KafkaError:
            return None
        return set(found) if found else None

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(kafka_errors.KafkaError):
            self._producer.close(timeout=timeout_s)


def _check_one_batch_per_partition(producer: KafkaProducer) -> None:
    """Refuse a kafka-python that would keep two batches of a partition in flight.

    Its sender mutes a partition while a batch of it is in flight (``guarantee_message_order``,
    on when idempotent since 3.0.12). With two in flight, a partition's first batch refused
    by a leader not serving yet, and the next one accepted, is how librdkafka came to call
    records delivered that were never written (docs/relay.md, "A proof is an offset"). A
    later kafka-python that pipelined a partition would reopen that loss: checked, not
    assumed.
    """
    sender = getattr(producer, "_sender", None)
    if not getattr(sender, "config", {}).get("guarantee_message_order"):
        producer.close(timeout=0)
        raise ConfigurationError(
            "this kafka-python producer may keep more than one batch of a partition in flight"
            " (its sender's guarantee_message_order is off): outboxkit needs one, to never"
            " take a refused batch for delivered; install kafka-python>=3.0.12,<3.1"
        )


def _refused(delivery: Delivery, exc: BaseException) -> None:
    # kafka-python's own exception is kept: its class name is what operators search for.
    delivery.error = exc
    delivery.permanent = isinstance(exc, PERMANENT_ERRORS)
    delivery.too_large = isinstance(exc, TOO_LARGE)


class _Listener(AsyncConsumerRebalanceListener):  # type: ignore[misc]
    """kafka-python 3 runs the listener on its IO thread, where a blocking commit raises;
    so the listener is a coroutine and awaits the asynchronous commit (the IO loop,
    heartbeats included, keeps running meanwhile)."""

    def __init__(self, consumer: KafkaConsumer, listener: RebalanceListener) -> None:
        self.consumer, self.listener = consumer, listener

    async def on_partitions_revoked(self, revoked: Any) -> None:
        partitions = [TopicPartition(*tp) for tp in revoked]
        offsets = dict(self.listener.to_commit(partitions))
        committed: dict[TopicPartition, int] = {}
        error: BaseException | None = None
        if offsets:
            try:
                await self.consumer.commit_async(_kafka_offsets(offsets))
                committed = offsets
            except Exception as exc:
                error = exc
        self.listener.revoked(partitions, committed, error)

    async def on_partitions_lost(self, lost: Any) -> None:
        self.listener.lost([TopicPartition(*tp) for tp in lost])

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.listener.assigned([TopicPartition(*tp) for tp in assigned])


def _kafka_offsets(offsets: Mapping[TopicPartition, int]) -> dict[Any, Any]:
    return {KafkaTopicPartition(*tp): OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()}


class KafkaPythonConsumer:
    def __init__(self, connection: Connection, options: ConsumerOptions) -> None:
        try:
            self._consumer = KafkaConsumer(
                **client_config(connection),
                group_id=options.group_id,
                client_id=options.client_id,
                enable_auto_commit=False,
                auto_offset_reset=options.auto_offset_reset,
                max_poll_records=options.max_poll_records,
                session_timeout_ms=options.session_timeout_ms,
                heartbeat_interval_ms=max(100, options.session_timeout_ms // 3),
                max_poll_interval_ms=options.max_poll_interval_ms,
                # New topics and partition changes are noticed within seconds, not minutes.
                metadata_max_age_ms=options.metadata_max_age_ms,
                request_timeout_ms=options.request_timeout_ms,
                metrics_enabled=False,  # read by nobody here: their cost for nothing
                **options.extra,
            )
        except kafka_errors.KafkaConfigurationError as exc:
            raise ValueError(str(exc)) from exc
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc

    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None:
        self._consumer.subscribe(list(topics), listener=_Listener(self._consumer, listener))

    def poll(self, timeout_ms: int, max_records: int) -> list[Any]:
        try:
            polled = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except kafka_errors.CorruptRecordError as exc:
            raise self._unreadable(exc) from exc
        except kafka_errors.KafkaError as exc:
            if not exc.retriable:
                raise
            # kafka-python 3.0 raises a lost broker (ECONNREFUSED while it looks for the group
            # coordinator) out of poll; librdkafka waits it out. A broker outage is not the
            # consumer's end: nothing this time, after the poll's wait, and poll again.
            log.warning("Kafka poll failed, retrying: %s", exc)
            time.sleep(min(timeout_ms, 1000) / 1000)
            return []
        if len(polled) == 1:
            return next(iter(polled.values()))
        return [r for batch in polled.values() for r in batch]

    def _unreadable(self, exc: BaseException) -> UnreadableRecord:
        """Where the unreadable record is, when kafka-python knows.

        kafka-python 3.0 keeps the half-read fetch of that partition, and polling over it
        again spins forever; so it is dropped here (a private attribute of the pinned
        version, checked by tests/e2e/test_consumer_unreadable.py), and the partition's
        position is the record.
        """
        error = translated(exc)
        assert isinstance(error, UnreadableRecord)
        fetcher = getattr(self._consumer, "_fetcher", None)
        broken = getattr(fetcher, "_next_partition_records", None)
        if broken is not None:
            fetcher._next_partition_records = None  # type: ignore[union-attr]
            tp = broken.topic_partition
            error.partition = TopicPartition(*tp)
            error.offset = int(self._consumer.position(tp))
        return error

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        try:
            self._consumer.commit(_kafka_offsets(offsets))
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc

    def commit_async(self, offsets: Mapping[TopicPartition, int], callback: CommitCallback) -> None:
        def answered(_sent: Any, response: Any) -> None:
            callback(offsets, response if isinstance(response, BaseException) else None)

        try:
            self._consumer.commit_async(_kafka_offsets(offsets), callback=answered)
        except kafka_errors.KafkaError as exc:
            callback(offsets, translated(exc))

    def unsubscribe(self) -> None:
        with contextlib.suppress(kafka_errors.KafkaError):
            self._consumer.unsubscribe()

    def member_id(self) -> str | None:
        return str(self._consumer.group_metadata().member_id or "") or None

    def pause(self, *partitions: TopicPartition) -> None:
        self._consumer.pause(*[KafkaTopicPartition(*tp) for tp in partitions])

    def resume(self, *partitions: TopicPartition) -> None:
        self._consumer.resume(*[KafkaTopicPartition(*tp) for tp in partitions])

    def paused(self) -> set[TopicPartition]:
        return {TopicPartition(*tp) for tp in self._consumer.paused()}

    def seek(self, partition: TopicPartition, offset: int) -> None:
        self._consumer.seek(KafkaTopicPartition(*partition), offset)

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(*tp) for tp in self._consumer.assignment()}

    def position(self, partition: TopicPartition) -> int | None:
        try:
            found = self._consumer.position(KafkaTopicPartition(*partition), timeout_ms=0)
        except Exception:
            return None
        return None if found is None else int(found)

    def highwater(self, partition: TopicPartition) -> int | None:
        found = self._consumer.highwater(KafkaTopicPartition(*partition))
        return None if found is None else int(found)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        try:
            found = self._consumer.partitions_for_topic(topic)
        except kafka_errors.KafkaError as exc:
            # kafka-python asks one node and raises if it refuses the connection: a broker
            # SIGKILLed seconds ago stays in the metadata until its session ends. Unknown
            # for now; the caller asks again and the next request goes to another node.
            if exc.retriable:
                return None
            raise translated(exc) from exc
        return set(found) if found else None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._consumer.close(autocommit=False)


class KafkaPythonAdmin:
    def __init__(self, connection: Connection, client_id: str, request_timeout_ms: int) -> None:
        try:
            self._admin = KafkaAdminClient(
                **client_config(connection), client_id=client_id,
                request_timeout_ms=request_timeout_ms,
            )
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc

    def list_topics(self) -> set[str]:
        try:
            return set(self._admin.list_topics())
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc

    def existing_topics(self, names: Collection[str]) -> set[str]:
        if not names:
            return set()
        try:  # a metadata request for these topics, allow_auto_topic_creation=False
            found = self._admin.describe_topics(sorted(names))
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        return {t["name"] for t in found if t["error_code"] == 0}

    def create_topic(self, name: str, partitions: int = -1, replication: int = -1) -> None:
        try:
            self._admin.create_topics([NewTopic(name, partitions, replication)])
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc

    def replication(self, topic: str) -> tuple[int, int]:
        try:
            described = self._admin.describe_topics([topic])
            brokers = self._admin.describe_cluster()["brokers"]
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        partitions = [p for t in described if t.get("name") == topic and not t.get("error_code")
                      for p in t.get("partitions", [])]
        fewest = min((len(p.get("replica_nodes") or ()) for p in partitions), default=0)
        return fewest, len(brokers)

    def topic_configs(
        self, topics: Collection[str], names: Collection[str]
    ) -> dict[str, dict[str, str] | None]:
        if not topics:
            return {}
        try:
            found = self._admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, t, configs=list(names))
                 for t in sorted(topics)],
                config_filter="all",  # the default reports only values changed from the broker's
            )
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        configs = found.get("topic", {}) if isinstance(found, dict) else {}
        result: dict[str, dict[str, str] | None] = {}
        for topic in topics:
            # kafka-python drops the per-topic error code: no entry is all we learn.
            entries = configs.get(topic) or {}
            values = {n: str(entries[n]["value"]) for n in names if n in entries}
            result[topic] = values or None
        return result

    def end_offsets(
        self, partitions: Collection[TopicPartition], timeout_s: float = 15.0
    ) -> dict[TopicPartition, int]:
        if not partitions:
            return {}
        try:
            found = self._admin.list_partition_offsets(
                {KafkaTopicPartition(*tp): OffsetSpec.LATEST for tp in partitions},
                timeout_ms=max(100, int(timeout_s * 1000)),
            )
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        return {TopicPartition(*tp): int(info.offset) for tp, info in found.items()}

    def consumer_groups(self) -> list[str]:
        try:
            found = self._admin.list_groups()
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        # kafka-python 3 answers dicts; 2.x answered (group id, protocol type) tuples.
        names = (g["group_id"] if isinstance(g, dict) else g[0] for g in found)
        return sorted(set(names))

    def committed_offsets(self, group: str) -> dict[TopicPartition, int]:
        try:
            found = self._admin.list_group_offsets({group: None}).get(group, {})
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        return {TopicPartition(tp.topic, tp.partition): int(meta.offset)
                for tp, meta in found.items() if meta.offset >= 0}

    def group_members(self, group: str) -> tuple[str, set[str]]:
        try:
            found = self._admin.describe_groups([group]).get(group) or {}
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc
        state = str(found.get("group_state") or "")
        members = {str(m.get("member_id")) for m in found.get("members") or []}
        return group_state(state), members

    def delete_topics(self, topics: Collection[str]) -> None:
        try:
            self._admin.delete_topics(list(topics))
        except kafka_errors.KafkaError as exc:
            raise translated(exc) from exc

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._admin.close()
