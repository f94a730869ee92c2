"""The relay's reading positions over the outbox log, and how a claim's rows are cut per lane
(the pure part of relay.claims)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from relay.claims import _reads
from relay.cursors import Cursor, LaneRead

NOW = datetime.now(UTC)


def row(ord_: int, lane: int, rid: int | None) -> tuple[Any, ...]:
    """A lane's cursor (snap, target, pos, lo, hi), the server's incarnation and whether the
    cursor is ahead of it, with one message of the lane (or none)."""
    message = (rid, "t", b"k", b"{}", "{}", "t", str(uuid.uuid4()), NOW.timestamp(), None)
    return (ord_, lane, "10:10:", "10:20:12", 0, 11, 19, None, False, False,
            *(message if rid else (None,) * 9))


def claimed(*rows: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """What the statement gives for *rows* (relay/queries.sql): each lane's own row (its
    cursor) first, then the messages, each with its lane only; in id order per lane."""
    lanes = {r[1]: r[:10] + (None,) * 9 for r in rows}
    return [*lanes.values(), *[(None, r[1]) + (None,) * 8 + r[10:] for r in rows if r[10]]]


MORE = 101  # a limit of 100, plus one to know there is more


def test_a_lane_read_to_the_end_of_its_difference_is_exhausted() -> None:
    fetched = [row(1, 5, 4), row(1, 5, 11), row(1, 5, 13)]
    rows, reads = _reads(claimed(*fetched), {5: 7}, room=100, more=MORE)
    assert [r.id for r in rows] == [4, 11, 13]
    assert reads[5] == LaneRead(5, Cursor(7, "10:10:", "10:20:12", 0, 11, 19), (4, 11, 13), True)


def test_the_room_left_cuts_the_last_lane_which_is_then_not_exhausted() -> None:
    fetched = [row(1, 0, 5), row(2, 1, 6), row(2, 1, 7), row(2, 1, 8)]
    rows, reads = _reads(claimed(*fetched), {0: 1, 1: 1}, room=3, more=MORE)
    assert [r.id for r in rows] == [5, 6, 7]
    assert reads[0].exhausted
    assert not reads[1].exhausted


def test_a_lane_at_its_limit_is_not_exhausted() -> None:
    fetched = [row(1, 0, i) for i in (5, 6, 7)]
    rows, reads = _reads(claimed(*fetched), {0: 1}, room=10, more=3)  # 3 came: more exist
    assert [r.id for r in rows] == [5, 6, 7]
    assert not reads[0].exhausted


def test_an_empty_difference_is_exhausted_and_moves_the_cursor_to_its_target() -> None:
    _, reads = _reads(claimed(row(1, 4, None)), {4: 9}, room=10, more=MORE)
    assert reads[4].exhausted
    assert reads[4].ids == ()
    assert reads[4].advanced(None) == Cursor(9, "10:20:12")


def test_the_cursor_passes_what_was_done_and_keeps_the_target_until_it_is_exhausted() -> None:
    read = LaneRead(0, Cursor(1, "10:10:", "10:20:12", 0, 11, 19), (11, 13, 15), False)
    assert read.advanced(13) == Cursor(1, "10:10:", "10:20:12", 13, 11, 19)
    assert read.advanced(None) == read.cursor  # the first row failed: nothing passed
    done = LaneRead(0, read.cursor, (11, 13, 15), True)
    assert done.advanced(15) == Cursor(1, "10:20:12")  # all done: the target is the cursor
    assert done.advanced(13) == Cursor(1, "10:10:", "10:20:12", 13, 11, 19)  # 15 failed
