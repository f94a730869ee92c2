"""The relay's reading positions over the outbox log, and how a claim's rows are cut per lane
(the pure part of relay.claims)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from relay.claims import _reads
from relay.cursors import Cursor, LaneRead

NOW = datetime.now(UTC)


def row(ord_: int, lane: int, rn: int | None, got: int, rid: int | None) -> tuple[Any, ...]:
    """A claim result row: the lane's cursor (snap, target, pos, lo, hi) then the message."""
    message = (rid, uuid.uuid4(), "t", b"k", "t", b"{}", {}, NOW, None) if rid else (None,) * 9
    return (ord_, lane, "10:10:", "10:20:12", 0, 11, 19, rn, got, *message)


def test_a_lane_read_to_the_end_of_its_difference_is_exhausted() -> None:
    rows, reads = _reads([row(1, 5, 1, 2, 11), row(1, 5, 2, 2, 13)], {5: 7}, room=100)
    assert [r.id for r in rows] == [11, 13]
    assert reads[5] == LaneRead(5, Cursor(7, "10:10:", "10:20:12", 0, 11, 19), (11, 13), True)


def test_a_lane_is_cut_at_its_first_missing_row_number_and_is_not_exhausted() -> None:
    # lane 2 came back 1, 2, 4 (of 4): keep 1, 2; lane 3 lacks its first row: keep nothing.
    fetched = [row(2, 2, 4, 4, 40), row(1, 1, 2, 2, 12), row(2, 2, 1, 4, 10),
               row(1, 1, 1, 2, 11), row(2, 2, 2, 4, 20), row(3, 3, 2, 2, 31)]
    rows, reads = _reads(fetched, {1: 1, 2: 1, 3: 1}, room=100)
    assert [r.id for r in rows] == [11, 12, 10, 20]
    assert (reads[1].exhausted, reads[2].exhausted, reads[3].exhausted) == (True, False, False)
    assert reads[3].ids == ()


def test_the_room_left_cuts_the_last_lane_which_is_then_not_exhausted() -> None:
    fetched = [row(1, 0, 1, 1, 5), row(2, 1, 1, 3, 6), row(2, 1, 2, 3, 7), row(2, 1, 3, 3, 8)]
    rows, reads = _reads(fetched, {0: 1, 1: 1}, room=3)
    assert [r.id for r in rows] == [5, 6, 7]
    assert reads[0].exhausted
    assert not reads[1].exhausted


def test_a_lane_with_more_rows_than_the_limit_is_not_exhausted() -> None:
    # got counts up to limit + 1: 3 means more than the 2 that came.
    rows, reads = _reads([row(1, 0, 1, 3, 5), row(1, 0, 2, 3, 6)], {0: 1}, room=10)
    assert len(rows) == 2
    assert not reads[0].exhausted


def test_an_empty_difference_is_exhausted_and_moves_the_cursor_to_its_target() -> None:
    _, reads = _reads([row(1, 4, None, 0, None)], {4: 9}, room=10)
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
