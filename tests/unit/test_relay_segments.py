"""A row that may be over its topic's limit is sent alone, between the rows around it.

tests/e2e/test_relay_failures.py (``middle``) shows why with a broker: sent in one go, a
refused batch in the middle of a key's run let librdkafka write the key's later records first.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from relay.claims import OutboxRow
from relay.segments import (
    RECORD_OVERHEAD,
    overtaken,
    record_bytes,
    segments,
    small_limit_warning,
    suspect,
)


def row(row_id: int, key: bytes | None = b"k", size: int = 10, topic: str = "t") -> OutboxRow:
    return OutboxRow(
        id=row_id, message_id=uuid.uuid4(), topic=topic, key=key, message_type="e",
        payload=b"x" * size, headers={}, created_at=datetime.now(UTC), lane=0,
    )


def test_a_suspect_goes_alone_between_the_rows_before_and_after_it() -> None:
    rows = [row(1), row(2), row(3, size=5000), row(4), row(5, size=5000), row(6, size=5000)]
    limits = {"t": 4000}
    cut = segments((r, suspect(r, record_bytes(r), limits)) for r in rows)
    assert [[r.id for r in part] for part in cut] == [[1, 2], [3], [4], [5], [6]]


def test_without_a_known_limit_nothing_is_a_suspect() -> None:
    rows = [row(1), row(2, size=5000, topic="other")]
    cut = segments((r, suspect(r, record_bytes(r), {"t": 4000})) for r in rows)
    assert [[r.id for r in part] for part in cut] == [[1, 2]]


def test_a_row_within_the_overhead_of_the_limit_is_a_suspect() -> None:
    near = row(1, size=4000 - RECORD_OVERHEAD)  # its key and type push it over
    assert suspect(near, record_bytes(near), {"t": 4000})
    assert not suspect(row(2, size=100), 100, {"t": 4000})


def test_a_refused_row_overtaken_by_a_later_row_of_its_key_is_reported() -> None:
    acked = [row(1), row(3), row(4, key=b"other"), row(5, key=None)]
    refused = [row(2), row(6, key=b"other"), row(7, key=None)]
    assert [(a.id, b.id) for a, b in overtaken(acked, refused)] == [(2, 3)]


def test_a_topic_limit_below_the_batch_size_is_warned_about() -> None:
    assert small_limit_warning("t", 1_048_588, 262_144) is None
    warning = small_limit_warning("t", 4000, 262_144)
    assert warning is not None
    assert "PRODUCER_BATCH_BYTES" in warning
