"""The confluent-kafka admin client behind :class:`outbox.kafka.api.Admin`."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
)
from confluent_kafka.admin import (  # type: ignore[attr-defined] # re-exported, not in __all__
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from outbox.kafka.api import (
    Connection,
    KafkaClientError,
    TopicPartition,
    group_state,
)
from outbox.kafka.confluent.librdkafka import (
    LATEST,
    WAIT_STEP_S,
    client_config,
    kafka_tp,
    serious,
    translated,
)


class ConfluentAdmin:
    def __init__(self, connection: Connection, client_id: str, request_timeout_ms: int) -> None:
        config = client_config(connection)
        config["client.id"] = client_id
        config["error_cb"] = self._on_error
        # Asking about a topic that does not exist must not create it (existing_topics):
        # librdkafka's admin client is a producer's, which may by default.
        config["allow.auto.create.topics"] = False
        # The client's last error of its own (a refused password): a request that timed out
        # says why, as kafka-python's admin raises the refusal itself.
        self._trouble: KafkaError | None = None
        try:
            self._admin = AdminClient(config)
        except KafkaException as exc:
            raise translated(exc) from exc
        self._timeout_s = request_timeout_ms / 1000

    def _on_error(self, err: KafkaError) -> None:
        if self._trouble is None or not serious(self._trouble) or serious(err):
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

    def _metadata(self, topic: str | None = None) -> Any:
        """The cluster's metadata, asked for a second at a time: a refusal the client met
        meanwhile (a wrong password, reported through error_cb at its first connection)
        ends the wait at once. Asked for the whole timeout, a relay with a wrong password
        waited 15 s per attempt, ready all the while, before it said anything."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            asked = time.monotonic()
            try:
                return self._admin.list_topics(
                    topic=topic, timeout=max(0.01, min(WAIT_STEP_S, deadline - asked)))
            except KafkaException as exc:
                self._admin.poll(0)  # serve the client's own errors (error_cb)
                now = time.monotonic()
                if now >= deadline or (self._trouble is not None and serious(self._trouble)):
                    raise self._failed(exc) from exc
                if now - asked < WAIT_STEP_S / 2:  # refused at once: not a wait to go on with
                    time.sleep(min(WAIT_STEP_S / 2, max(0.0, deadline - now)))

    def list_topics(self) -> set[str]:
        return set(self._metadata().topics)

    def existing_topics(self, names: Collection[str]) -> set[str]:
        found = set()
        for name in sorted(names):  # one metadata request each: a batch names few topics
            topic = self._metadata(name).topics.get(name)
            if topic is not None and not topic.error:
                found.add(name)
        return found

    def replication(self, topic: str) -> tuple[int, int]:
        metadata = self._metadata(topic)
        found = metadata.topics.get(topic)
        partitions = found.partitions.values() if found is not None and not found.error else ()
        fewest = min((len(p.replicas) for p in partitions), default=0)
        return fewest, len(metadata.brokers)

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
                {kafka_tp(tp): LATEST for tp in partitions}, request_timeout=timeout_s
            )
            return {
                TopicPartition(tp.topic, tp.partition): int(future.result().offset)
                for tp, future in futures.items()
            }
        except KafkaException as exc:
            raise translated(exc) from exc

    def consumer_groups(self) -> list[str]:
        try:
            found = self._admin.list_consumer_groups(request_timeout=self._timeout_s).result()
        except KafkaException as exc:
            raise translated(exc) from exc
        return sorted({g.group_id for g in found.valid})

    def committed_offsets(self, group: str) -> dict[TopicPartition, int]:
        try:
            futures = self._admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group)], request_timeout=self._timeout_s)
            answer = futures[group].result()
        except KafkaException as exc:
            raise translated(exc) from exc
        return {TopicPartition(tp.topic, tp.partition): int(tp.offset)
                for tp in answer.topic_partitions or [] if tp.offset >= 0}

    def group_members(self, group: str) -> tuple[str, set[str]]:
        try:
            futures = self._admin.describe_consumer_groups(
                [group], request_timeout=self._timeout_s)
            found = futures[group].result()
        except KafkaException as exc:
            raise translated(exc) from exc
        return group_state(found.state.name), {m.member_id for m in found.members}

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
