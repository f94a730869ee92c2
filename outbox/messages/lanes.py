"""Where a message goes: its relay lane, and the lock that keeps one key in commit order."""

from __future__ import annotations

import uuid

from outbox.db.hashing import stable_hash64


def lane_for(key: bytes | None, message_id: uuid.UUID, lanes: int) -> int:
    """The relay lane of a message: by key, so one key stays in one lane (and in order);
    keyless messages are spread by their id."""
    return stable_hash64(key if key is not None else message_id.bytes) % lanes


def ordering_lock_key(topic: str, key: bytes | None) -> int | None:
    """The advisory lock that serialises emits of one (topic, key) until commit; ``None``
    (no lock) for keyless messages, which promise no order."""
    if key is None:
        return None
    return stable_hash64(b"outboxkit.key", topic.encode(), key)
