"""A claim cut by its limit across lanes never passes rows it did not see.

The statement gives each lane the smallest ids of its difference, in id order (its two parts
merged and limited in SQL). The claim's limit across lanes can cut the last lane that came:
what came of it is then a prefix, and its cursor must remember the last id taken rather than
take the difference as read to its end (its rows past the cut would be passed unread: lost).
An earlier claim, which merged the parts in Python, lost 4-5 of 20,000 messages that way in
about one run in four of tests/e2e/test_relay_crashes.py.
"""

from __future__ import annotations

from typing import Any

from relay.claims import OutboxRow, Published, _proofs, _reads
from relay.cursors import Cursor

SNAP, TARGET = "10:20:12", "30:30:"


def row(lane: int, row_id: int | None, ord_: int = 1) -> tuple[Any, ...]:
    """The statement's row of a message of *lane* (the lane's own row when *row_id* is None)."""
    if row_id is None:
        return (ord_, lane, SNAP, TARGET, 0, 100, 200, None, False, False) + (None,) * 9
    return (None, lane) + (None,) * 8 + (row_id, "t", b"k", b"x", "{}", "type",
                                         f"00000000-0000-0000-0000-{row_id:012d}", 0.0, None)


def lanes(*ords: tuple[int, int]) -> list[tuple[Any, ...]]:
    """The lanes' own rows, which come first: (lane, ord) each."""
    return [row(lane, None, ord_) for lane, ord_ in ords]


def test_a_lane_cut_by_the_claims_limit_is_a_prefix_not_the_whole() -> None:
    fetched = [*lanes((3, 1)), row(3, 5), row(3, 6)]
    rows, reads = _reads(fetched, {3: 7}, room=1000, more=1001, cut=True)
    assert [r.id for r in rows] == [5, 6]
    assert not reads[3].exhausted  # read on from id 6 next time
    assert reads[3].advanced(6).pos == 6
    assert reads[3].advanced(6).target == TARGET


def test_the_same_rows_without_a_cut_are_the_whole_lane() -> None:
    fetched = [*lanes((3, 1)), row(3, 5), row(3, 6)]
    rows, reads = _reads(fetched, {3: 7}, room=1000, more=1001, cut=False)
    assert [r.id for r in rows] == [5, 6]
    assert reads[3].exhausted


def test_a_lane_before_the_cut_one_is_whole() -> None:
    fetched = [*lanes((2, 1), (3, 2)), row(2, 1), row(2, 4), row(3, 5)]
    rows, reads = _reads(fetched, {2: 1, 3: 7}, room=1000, more=1001, cut=True)
    assert [r.id for r in rows] == [1, 4, 5]
    assert reads[2].exhausted
    assert not reads[3].exhausted


def test_a_lane_with_more_rows_than_its_limit_is_not_read_to_its_end() -> None:
    fetched = [*lanes((3, 1)), *[row(3, i) for i in range(1, 5)]]  # more=4: per-lane limit
    rows, reads = _reads(fetched, {3: 7}, room=3, more=4)
    assert [r.id for r in rows] == [1, 2, 3]
    assert not reads[3].exhausted
    assert reads[3].ids == (1, 2, 3)


def test_an_empty_lane_is_read_to_its_end() -> None:
    rows, reads = _reads(lanes((3, 1)), {3: 7}, room=10, more=11)
    assert rows == []
    assert reads[3].exhausted
    assert reads[3].ids == ()


def test_the_lanes_after_the_cut_one_were_not_reached_and_are_not_read() -> None:
    # Every lane's own row comes first; when the limit cut lane 3, lane 4 (after it in the
    # same order) had no chance to bring its rows: it must not count as read to its end.
    fetched = [*lanes((2, 1), (3, 2), (4, 3)), row(2, 1), row(3, 5)]
    rows, reads = _reads(fetched, {2: 1, 3: 7, 4: 2}, room=1000, more=1001, cut=True)
    assert [r.id for r in rows] == [1, 5]
    assert reads[2].exhausted
    assert not reads[3].exhausted
    assert not reads[4].exhausted
    assert reads[4].ids == ()
    # Its position stays; the difference's target and id range are kept for the next claim.
    kept = reads[4].advanced(None)
    assert (kept.snapshot, kept.target, kept.pos) == (SNAP, TARGET, 0)
    assert (kept.floor, kept.ceil) == (100, 200)


def test_a_batchs_proof_is_one_row_per_lane_its_ids_in_order() -> None:
    def sent(lane: int, row_id: int, partition: int, offset: int) -> Published:
        row = OutboxRow(row_id, "m", "t", b"k", "type", b"x", "{}", 0.0, lane)
        return Published(row, partition, offset)

    # A retried row (id 3) is sent before the lane's claimed rows (ids 5 and 9).
    published = [sent(2, 3, 1, 40), sent(4, 6, 0, 10), sent(2, 5, 0, 11), sent(2, 9, 1, 41)]
    proofs = _proofs(published, {2: (Cursor(7, SNAP), 2), 4: (Cursor(8, SNAP), 1)})
    assert proofs == {
        "lanes": "{2,4}",
        "tokens": "{7,8}",
        "first_ids": "{3,6}",
        "last_ids": "{9,6}",
        "ids": '{"{3,5,9}","{6}"}',
        "partitions": '{"{1,0,1}","{0}"}',
        "offsets": '{"{40,11,41}","{10}"}',
    }
