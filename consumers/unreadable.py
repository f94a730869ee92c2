"""Records kafka-python cannot parse (e.g. a header name that is not UTF-8).

``poll()`` raises ``CorruptRecordError`` at such a record every time it is reached, so
without help the partition would stop for good. The record never reaches us as bytes, so it
cannot be dead-lettered; instead its position and the parser's error go to the failures
table (status ``dead-lettered``, no dead-letter topic), where ``outbox dlq list`` shows it
and an operator can read it with other tools, and the partition moves past it.

kafka-python cannot read past the bad record *within its record batch* either: records that
a producer batched after it fail the same way, and each is recorded and skipped by its
own position in turn. Nothing is skipped without a row naming its offset.
"""

from __future__ import annotations

import logging
from typing import Any

from kafka import TopicPartition
from kafka import errors as kafka_errors
from sqlalchemy import Engine

from consumers.metrics import ConsumerMetrics
from consumers.offsets import OffsetTracker
from dedup import failures

log = logging.getLogger(__name__)
NOT_FORWARDED = "(unreadable: not forwarded)"


def find_culprit(consumer: Any) -> tuple[TopicPartition, int] | None:
    """The partition and offset of the record that failed to parse.

    kafka-python 3.0 keeps the half-read fetch of that partition, and polling over it again
    spins forever; so it is dropped here (a private attribute of the pinned version, checked
    by tests/e2e/test_consumer_unreadable.py), and the partition's position is the record.
    Otherwise (the fetch failed as a whole) each partition is polled alone until one raises.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    broken = getattr(fetcher, "_next_partition_records", None)
    if broken is not None:
        fetcher._next_partition_records = None  # type: ignore[union-attr]
        tp = broken.topic_partition
        return tp, int(consumer.position(tp))
    return _probe(consumer)


def _probe(consumer: Any) -> tuple[TopicPartition, int] | None:
    """Poll each assigned partition alone; records a probe reads are sought back to."""
    assigned = sorted(consumer.assignment(), key=lambda tp: (tp.topic, tp.partition))
    # Seeking to where each partition is drops what the fetcher buffered: polling again over
    # the fetch that failed to parse spins forever in kafka-python 3.0.
    for tp in assigned:
        consumer.seek(tp, consumer.position(tp))
    culprit = None
    try:
        for tp in assigned:
            consumer.pause(*[other for other in assigned if other != tp])
            consumer.resume(tp)
            position = consumer.position(tp)
            try:
                got = consumer.poll(timeout_ms=500, max_records=1)
            except kafka_errors.CorruptRecordError:
                culprit = (tp, position)
                break
            if got:
                consumer.seek(tp, position)
    finally:
        consumer.resume(*assigned)
    return culprit


def skip_unreadable(consumer: Any, engine: Engine, *, group: str, error: BaseException,
                    offsets: OffsetTracker, metrics: ConsumerMetrics) -> bool:
    """Record the unreadable record and move its partition past it; False if not found."""
    culprit = find_culprit(consumer)
    if culprit is None:
        return False
    tp, offset = culprit
    text = f"{type(error).__name__}: {error}"[:4000]
    with engine.begin() as conn:
        failures.record_attempt(
            conn, group=group, topic=tp.topic, partition=tp.partition, offset=offset,
            message_id=None, key=None, payload=None, headers={}, error=text)
        failures.mark_dead_lettered(
            conn, group=group, topic=tp.topic, partition=tp.partition, offset=offset,
            dlq_topic=NOT_FORWARDED, dlq_partition=None, dlq_offset=None)
    consumer.seek(tp, offset + 1)
    offsets.done([_Position(tp.topic, tp.partition, offset)])
    metrics.dead_lettered.labels(tp.topic).inc()
    log.error("record %s[%d]@%d cannot be parsed by the Kafka client (%s): recorded in the "
              "failures table and skipped", tp.topic, tp.partition, offset, text,
              extra={"event": "consumer.unreadable"})
    return True


class _Position:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset
