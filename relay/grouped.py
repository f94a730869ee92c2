"""Light traffic: the records of clean batches written together (pure logic).

An idle relay sends a batch per wake-up, a row or two each, and recorded each one in its own
statement: about a fifth of its CPU at 200 messages a second, and a write transaction each
for PostgreSQL. Records of clean batches (every row acknowledged, nothing refused, set aside
or retried) acknowledged within ``record_group_ms`` of the first are held and written as one:
the proofs side by side, each lane's cursor the latest. Nothing is published later for it:
only the proof and the cursor's move wait. If the relay dies meanwhile, those rows are sent
again from the database's cursors, as a batch whose record was in flight is: duplicates with
the same message ids, never a loss.

Batches join only while read under the same server incarnation and the same lane tokens, so
that the one statement is fenced exactly as each batch's own would have been.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from relay.claims import Published
from relay.cursors import Cursor

# A lane's new cursor and how many of its rows were published (relay.claims.record).
Moves = dict[int, tuple[Cursor, int]]


@dataclass
class Held:
    """Clean batches acknowledged, not recorded yet; due for their record at ``due``
    (time.monotonic)."""

    published: list[Published]
    moves: Moves
    incarnation: uuid.UUID | None
    tokens: dict[int, int]
    due: float

    def takes(self, incarnation: uuid.UUID | None, tokens: Mapping[int, int]) -> bool:
        """Whether a batch read under *incarnation* and *tokens* can join this record."""
        if incarnation != self.incarnation:
            return False
        return all(self.tokens.get(lane, token) == token for lane, token in tokens.items())

    def add(self, published: list[Published], moves: Moves, tokens: Mapping[int, int]) -> None:
        """A later batch joins: its proofs after these, its cursors over these."""
        self.published += published
        for lane, (cursor, count) in moves.items():
            before = self.moves.get(lane)
            self.moves[lane] = (cursor, count + (before[1] if before is not None else 0))
        self.tokens.update(tokens)
