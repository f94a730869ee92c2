"""Stable 64-bit hashes: the same on every process and Python version (unlike ``hash()``)."""

from __future__ import annotations

import hashlib


def stable_hash64(*parts: bytes) -> int:
    """A signed 64-bit hash of *parts*, usable as a PostgreSQL advisory lock key (``bigint``).

    Each part is length-prefixed, so ``(b"ab", b"c")`` and ``(b"a", b"bc")`` differ.
    """
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "big", signed=True)
