"""What the consumer's watchdog (:mod:`consumers.watchdog`) asks the brokers, apart from the
consumer's own Kafka client: whether they answer, what waits behind the client's positions,
and whether its group counts it as a member.

One admin client, kafka-python's whichever client consumes, made on first use and kept for
the process's life: librdkafka's admin requests to a group coordinator that is away aborted
the process (an ``rd_kafka_enq_once`` assertion, in two broker-outage tests of three with
librdkafka 2.16). Every question answers None when the brokers do not.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from consumers.settings import ConsumerSettings
from consumers.watchdog import GroupView
from outbox.kafka import Admin, KafkaClientError, TopicPartition, backend


class Brokers:
    def __init__(self, settings: ConsumerSettings, group_id: str) -> None:
        self.settings, self.group_id = settings, group_id
        self._admin: Admin | None = None

    def _client(self) -> Admin | None:
        if self._admin is None:
            try:
                self._admin = backend("kafka-python", self.settings.kafka_connection()).admin(
                    f"outboxkit-{self.group_id}-watchdog",
                    request_timeout_ms=min(5000, self.settings.session_timeout_ms))
            except KafkaClientError:
                return None
        return self._admin

    def answer(self) -> str | None:
        """None if the brokers answer a metadata request; else why not."""
        admin = self._client()
        if admin is None:
            return "no admin client could be made"
        try:
            admin.list_topics()
        except KafkaClientError as exc:
            return str(exc)
        return None

    def behind(self, consumer: Any, partitions: Collection[TopicPartition]) -> int | None:
        """Records after *consumer*'s positions on *partitions*, by the brokers' end offsets.
        A partition without a position waits too: the client has not even learnt where to
        start (a committed-offset request hanging on its coordinator)."""
        admin = self._client()
        if admin is None:
            return None
        try:
            ends = admin.end_offsets(partitions, timeout_s=5)
        except KafkaClientError:
            return None
        waiting = 0
        for tp, end in ends.items():
            position = consumer.position(tp)
            waiting += 1 if position is None else max(0, end - position)
        return waiting

    def group(self, consumer: Any) -> GroupView | None:
        """The group's state and whether *consumer* is among its members."""
        admin = self._client()
        if admin is None:
            return None
        try:
            state, members = admin.group_members(self.group_id)
        except KafkaClientError:
            return None
        return state, consumer.member_id() in members

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()
