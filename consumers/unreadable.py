"""Records the Kafka client cannot parse (e.g. a header name that is not UTF-8).

``poll()`` raises ``UnreadableRecord`` at such a record every time it is reached, so
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

from sqlalchemy import Engine

from consumers import failures
from consumers.metrics import ConsumerMetrics
from outbox.kafka import TopicPartition, UnreadableRecord

log = logging.getLogger(__name__)
NOT_FORWARDED = "(unreadable: not forwarded)"


def find_culprit(consumer: Any, error: UnreadableRecord) -> tuple[TopicPartition, int] | None:
    """The partition and offset of the record that failed to parse: where the client said,
    or else found by polling each partition alone until one raises."""
    if error.partition is not None and error.offset is not None:
        return error.partition, error.offset
    return _probe(consumer)


def _probe(consumer: Any) -> tuple[TopicPartition, int] | None:
    """Poll each assigned partition alone; records a probe reads are sought back to."""
    assigned = sorted(consumer.assignment(), key=lambda tp: (tp.topic, tp.partition))
    # Seeking to where each partition is drops what the fetcher buffered: polling again over
    # the fetch that failed to parse spins forever in kafka-python 3.0.
    for tp in assigned:
        where = consumer.position(tp)
        if where is not None:
            consumer.seek(tp, where)
    culprit = None
    try:
        for tp in assigned:
            consumer.pause(*[other for other in assigned if other != tp])
            consumer.resume(tp)
            position = consumer.position(tp)
            try:
                got = consumer.poll(timeout_ms=500, max_records=1)
            except UnreadableRecord:
                if position is not None:
                    culprit = (tp, position)
                break
            if got and position is not None:
                consumer.seek(tp, position)
    finally:
        consumer.resume(*assigned)
    return culprit


def skip_unreadable(consumer: Any, engine: Engine, *, group: str, error: UnreadableRecord,
                    metrics: ConsumerMetrics) -> tuple[TopicPartition, int] | None:
    """Record the unreadable record and move its partition past it: its position, which the
    caller counts as done (None if not found)."""
    culprit = find_culprit(consumer, error)
    if culprit is None:
        return None
    tp, offset = culprit
    text = str(error)[:4000]  # it starts with the client's own name for the error
    with engine.begin() as conn:
        failures.record_attempt(
            conn, group=group, topic=tp.topic, partition=tp.partition, offset=offset,
            message_id=None, key=None, payload=None, headers={}, error=text)
        failures.mark_dead_lettered(
            conn, group=group, topic=tp.topic, partition=tp.partition, offset=offset,
            dlq_topic=NOT_FORWARDED, dlq_partition=None, dlq_offset=None)
    consumer.seek(tp, offset + 1)
    metrics.dead_lettered.labels(tp.topic).inc()
    log.error("record %s[%d]@%d cannot be parsed by the Kafka client (%s): recorded in the "
              "failures table and skipped", tp.topic, tp.partition, offset, text,
              extra={"event": "consumer.unreadable"})
    return culprit


class SkippedRecord:
    """A record's position where only its position is known (an unreadable record)."""

    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset
