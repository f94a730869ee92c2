"""Kafka clients behind one small interface (:mod:`outbox.kafka.api`), two backends.

``kafka-python`` (the default) is pure Python; ``confluent`` is librdkafka through
confluent-kafka (``pip install 'outboxkit[confluent]'``), several times faster at both ends.
Both partition keys alike (murmur2, as the Java client), so switching keeps every key in its
partition. Choose with ``OUTBOXKIT_KAFKA_CLIENT`` (or a daemon's own
``OUTBOXKIT_RELAY_KAFKA_CLIENT`` / ``OUTBOXKIT_CONSUMER_KAFKA_CLIENT``).
"""

from __future__ import annotations

import importlib

from outbox.errors import ConfigurationError
from outbox.kafka.api import (
    CLIENT_NAMES,
    NO_OFFSET,
    Admin,
    Backend,
    ClientName,
    CommitRefused,
    Connection,
    Consumer,
    ConsumerOptions,
    Delivery,
    KafkaClientError,
    Outgoing,
    Producer,
    ProducerOptions,
    RebalanceListener,
    Record,
    RecordTooLarge,
    TopicExists,
    TopicInvalid,
    TopicPartition,
    UnreadableRecord,
)

__all__ = [
    "CLIENT_NAMES",
    "NO_OFFSET",
    "Admin",
    "Backend",
    "ClientName",
    "CommitRefused",
    "Connection",
    "Consumer",
    "ConsumerOptions",
    "Delivery",
    "KafkaClientError",
    "Outgoing",
    "Producer",
    "ProducerOptions",
    "RebalanceListener",
    "Record",
    "RecordTooLarge",
    "TopicExists",
    "TopicInvalid",
    "TopicPartition",
    "UnreadableRecord",
    "backend",
    "describe_client",
]


def backend(name: str, connection: Connection) -> Backend:
    """The backend called *name* (one of :data:`CLIENT_NAMES`), bound to *connection*."""
    if name == "kafka-python":
        from outbox.kafka.kafka_python import KafkaPythonBackend  # noqa: PLC0415

        return KafkaPythonBackend(connection)
    if name == "confluent":
        try:
            from outbox.kafka.confluent import ConfluentBackend  # noqa: PLC0415
        except ImportError as exc:
            raise ConfigurationError(
                "OUTBOXKIT_KAFKA_CLIENT=confluent needs the confluent-kafka package, which is "
                f"not installed ({exc}): pip install 'outboxkit[confluent]', or set "
                "OUTBOXKIT_KAFKA_CLIENT=kafka-python"
            ) from exc
        return ConfluentBackend(connection)
    raise ConfigurationError(
        f"unknown Kafka client {name!r}: set OUTBOXKIT_KAFKA_CLIENT to one of "
        + ", ".join(CLIENT_NAMES)
    )


def describe_client(name: str) -> str:
    """The Kafka client called *name* and its version, as the daemons' start-up lines name it:
    ``kafka-python 3.0.12``, or ``confluent-kafka 2.16.1 (librdkafka 2.16.0)`` — librdkafka
    can differ from the wheel's own version when it is linked from the system."""
    if name == "kafka-python":
        return f"kafka-python {_module_version('kafka')}"
    if name == "confluent":
        try:
            confluent_kafka = importlib.import_module("confluent_kafka")
        except ImportError:
            return "confluent-kafka (not installed)"
        return (f"confluent-kafka {_module_version('confluent_kafka')} "
                f"(librdkafka {confluent_kafka.libversion()[0]})")
    return f"{name} (unknown client)"


def _module_version(module: str) -> str:
    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return "(version unknown)"
