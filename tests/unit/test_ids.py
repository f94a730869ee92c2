"""Message ids are version 7 UUIDs: time first, so dedup marks and the outbox's index grow
at their right edge."""

from __future__ import annotations

import time
import uuid

from outbox.messages.envelope import Envelope
from outbox.messages.ids import uuid7


def test_a_uuid7_has_version_7_the_rfc_variant_and_the_time_in_its_first_48_bits() -> None:
    before = time.time_ns() // 1_000_000
    made = uuid7()
    after = time.time_ns() // 1_000_000
    assert made.version == 7
    assert made.variant == uuid.RFC_4122
    assert before <= made.int >> 80 <= after


def test_later_ids_sort_after_earlier_ones_and_none_repeats() -> None:
    first = [uuid7() for _ in range(1000)]
    time.sleep(0.002)
    later = uuid7()
    assert all(later > earlier for earlier in first)
    assert len({uuid7() for _ in range(50_000)}) == 50_000


def test_an_envelope_gets_a_uuid7_message_id_unless_given_one() -> None:
    assert Envelope(topic="t", type="x", payload={}).message_id.version == 7
    given = uuid.uuid4()
    assert Envelope(topic="t", type="x", payload={}, message_id=given).message_id == given
