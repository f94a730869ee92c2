"""Cutting a claim's rows into sends, so that a record the broker may refuse goes alone.

An idempotent producer does not stop at a refused batch. When the broker refuses a batch
(e.g. over the topic's ``max.message.bytes``), librdkafka bumps the producer's epoch and the
batches behind it on the partition are written; so a later record of the refused one's key,
or of a good record's key refused with it in its batch, lands first. Re-sending the refused
rows afterwards (the relay's isolation) cannot undo that: the key's first deliveries are out
of commit order, and in block mode the rows behind a held key are already out.

The broker's size limit is known in advance, so the relay does not find out by sending: a
row that may be over its topic's limit (*suspect*) is sent alone, after everything before it
in the claim was answered, and the rows after it only once it was. A refused suspect is
then alone in its batch (no good record refused with it), and nothing of its key behind it
is in flight. The records of a batch of good rows fit: the producer closes a batch before it
grows past its ``batch_size``, and a topic whose limit is below that is warned about
(:func:`small_limit_warning`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from relay.claims import OutboxRow

# What a record adds to its key, value and header bytes once it is alone in a batch: the
# batch's header (61 bytes), the record's lengths and deltas, and the headers the relay adds
# (message id, type and the names). Generous: a row this close to its limit is only sent
# alone, which costs a round trip, never a refusal.
RECORD_OVERHEAD = 256


def record_bytes(row: OutboxRow) -> int:
    """The row's key, value and envelope headers as Kafka gets them, uncompressed."""
    return (
        len(row.payload)
        + len(row.key or b"")
        + sum([len(k) + len(v) for k, v in row.record_headers])
    )


def suspect(row: OutboxRow, size: int, limits: Mapping[str, int]) -> bool:
    """Whether the broker may refuse *row* (of *size* :func:`record_bytes`) as too large."""
    limit = limits.get(row.topic)
    return limit is not None and size + len(row.message_type) + RECORD_OVERHEAD > limit


def segments(rows: Iterable[tuple[OutboxRow, bool]]) -> list[list[OutboxRow]]:
    """Rows (in claim order, each with whether it is a suspect) cut into sends: every
    suspect alone, the rows between suspects together, in order."""
    cut: list[list[OutboxRow]] = []
    current: list[OutboxRow] = []
    for row, is_suspect in rows:
        if not is_suspect:
            current.append(row)
            continue
        if current:
            cut.append(current)
            current = []
        cut.append([row])
    if current:
        cut.append(current)
    return cut


def overtaken(
    acknowledged: Iterable[OutboxRow], refused: Iterable[OutboxRow]
) -> list[tuple[OutboxRow, OutboxRow]]:
    """(refused row, later row of its key acknowledged in the same send) pairs: the key's
    order is already broken in Kafka, whatever is sent next. Keyless rows have no order."""
    last_acked: dict[tuple[str, bytes], OutboxRow] = {}
    for row in acknowledged:
        if row.key is None:
            continue
        key = (row.topic, row.key)
        if key not in last_acked or row.id > last_acked[key].id:
            last_acked[key] = row
    broken: list[tuple[OutboxRow, OutboxRow]] = []
    for row in refused:
        later = last_acked.get((row.topic, row.key)) if row.key is not None else None
        if later is not None and later.id > row.id:
            broken.append((row, later))
    return broken


def small_limit_warning(topic: str, limit: int, batch_bytes: int) -> str | None:
    """What to tell an operator when *topic*'s limit is below the producer's batch size: a
    batch of rows that each fit can be over it, and is refused whole."""
    if limit >= batch_bytes:
        return None
    return (
        f"topic {topic}'s max.message.bytes ({limit}) is below the relay's producer batch "
        f"size ({batch_bytes}, OUTBOXKIT_RELAY_PRODUCER_BATCH_BYTES): a batch of messages "
        "that each fit can be refused whole, and with it the order of their keys. Raise the "
        "topic's limit or lower the batch size"
    )
