"""What librdkafka needs and says: its settings for a :class:`~outbox.kafka.api.Connection`,
and its error codes sorted and turned into the interface's errors."""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import (
    KafkaError,
    KafkaException,
)
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined] # re-exported, not in __all__
    OffsetSpec,
)

from outbox.kafka.api import (
    CommitRefused,
    Connection,
    KafkaClientError,
    TopicExists,
    TopicInvalid,
)
from outbox.kafka.confluent.logbridge import RepeatsSkipped

# librdkafka's own log lines (the application decides where they go).
log = logging.getLogger("outbox.kafka.confluent")

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
        "logger": RepeatsSkipped(log),
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


def serious(err: KafkaError) -> bool:
    return err.fatal() or err.code() in CONSUMER_FATAL_CODES


def as_error(err: KafkaError, kind: type[KafkaClientError] = KafkaClientError) -> KafkaClientError:
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
    error = as_error(err, kind)
    error.__cause__ = exc
    return error


def kafka_tp(tp: tuple[str, int], offset: int | None = None) -> KafkaTopicPartition:
    if offset is None:
        return KafkaTopicPartition(tp[0], tp[1])
    return KafkaTopicPartition(tp[0], tp[1], offset)


def topic_partitions(client: Any, topic: str, timeout_s: float) -> set[int] | None:
    """*topic*'s partitions as *client*'s metadata (a producer or consumer) knows them;
    None when unknown (not there yet, an error, no answer in time)."""
    try:
        found = client.list_topics(topic, timeout=timeout_s)
    except KafkaException:
        return None
    meta = found.topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        return None
    return set(meta.partitions)
