"""The confluent-kafka (librdkafka) backend of :mod:`outbox.kafka.api`.

``pip install 'outboxkit[confluent]'``. librdkafka sends and fetches in C threads: the
Python left per record is one ``produce`` call and its delivery callback, or one message
turned into a :class:`~outbox.kafka.api.Record`. Keys go to the partitions kafka-python and
the Java client choose (murmur2), so switching backends keeps every key in its partition.

librdkafka's log lines go to the ``outbox.kafka.confluent`` logger (the application decides
where they end up; nothing here configures logging).
"""

from __future__ import annotations

from outbox.kafka.api import ClientName, Connection, ConsumerOptions, ProducerOptions
from outbox.kafka.confluent.admin import ConfluentAdmin
from outbox.kafka.confluent.consumer import ConfluentConsumer
from outbox.kafka.confluent.producer import ConfluentProducer

__all__ = ["ConfluentAdmin", "ConfluentBackend", "ConfluentConsumer", "ConfluentProducer"]


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
