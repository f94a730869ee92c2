"""The confluent-kafka producer behind :class:`outbox.kafka.api.Producer`: one ``produce`` call
and one delivery callback of Python per record."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from confluent_kafka import (
    KafkaError,
    KafkaException,
    Message,
    Producer,
)

from outbox.kafka.api import (
    Connection,
    Delivery,
    Headers,
    KafkaClientError,
    Outgoing,
    ProducerOptions,
    no_offset,
)
from outbox.kafka.confluent.librdkafka import (
    PERMANENT_CODES,
    QUEUE_FULL_PAUSE_S,
    TOO_LARGE_CODES,
    WAIT_STEP_S,
    as_error,
    client_config,
    serious,
    topic_partitions,
)


@dataclass(slots=True)
class _Answer(Delivery):
    """A Delivery that is its own delivery callback: no closure per record on the hot path."""

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if self.error is not None:
            return  # answered already (given up on at the timeout): the caller has it
        if err is not None:
            _refused(self, err)
        elif (offset := msg.offset()) is not None:
            self.partition, self.offset = msg.partition() or 0, offset
        else:
            self.error = no_offset()  # transient: sent again (outbox.kafka.api.no_offset)


def _refused(delivery: Delivery, err: KafkaError) -> None:
    delivery.error = as_error(err)
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
            # One request in flight per broker: with more, a partition's next batch can be
            # on its way when the one before is refused (a leader not serving yet), be
            # accepted, and librdkafka then reports the refused records delivered without
            # an offset, although they were never written (outbox.kafka.api.no_offset).
            # A drain of 100,000 rows measured the same with 1 and 5 (37,543 / 44,031
            # against 40,012 / 42,848 msg/s first to last, interleaved).
            "max.in.flight.requests.per.connection": 1,
            "linger.ms": options.linger_ms,
            "batch.size": options.batch_bytes,
            "compression.type": options.compression,
            "message.max.bytes": options.max_request_bytes,
            "delivery.timeout.ms": options.delivery_timeout_ms,
            "request.timeout.ms": options.request_timeout_in_delivery_ms,
            # librdkafka's client-side wait for any request (60 s by default): a request to a
            # broker that hangs is given up after it, not after request.timeout.ms.
            "socket.timeout.ms": options.request_timeout_ms,
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
        records: Iterable[Outgoing],
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
        if self._trouble is None or not serious(self._trouble) or serious(err):
            self._trouble = err

    def partitions_for(self, topic: str) -> set[int] | None:
        return topic_partitions(self._producer, topic, self.options.max_block_ms / 1000)

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(Exception):
            if self._producer.flush(timeout_s) > 0:
                # What is still queued is given up (kafka-python drops it the same way).
                self._producer.purge()
                self._producer.poll(0)
