"""A batch read ahead is used only when it was read from what is in force when it is wanted
(relay/readahead.py): reading has no effect, so anything else drops it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from relay.claims import Claimed
from relay.cursors import Cursor
from relay.readahead import ReadAhead

LANES = {0: 7, 1: 7}
SOURCE: dict[int, Cursor | int] = {0: Cursor(7, "10:10:", "12:12:", 5), 1: 7}


def batch() -> Claimed:
    return Claimed([], {}, {})


@pytest.fixture
def ahead() -> Iterator[ReadAhead]:
    made = ReadAhead()
    yield made
    made.close()


def test_the_batch_read_from_the_same_cursors_is_taken(ahead: ReadAhead) -> None:
    read = batch()
    ahead.start(lambda source: read, LANES, SOURCE, "inc")
    assert ahead.take(dict(LANES), dict(SOURCE), "inc") is read
    assert ahead.take(LANES, SOURCE, "inc") is None  # taken once


@pytest.mark.parametrize("change", ["cursor", "token", "lanes", "incarnation"])
def test_anything_else_drops_it(ahead: ReadAhead, change: str) -> None:
    ahead.start(lambda source: batch(), LANES, SOURCE, "inc")
    lanes, source, incarnation = dict(LANES), dict(SOURCE), "inc"
    if change == "cursor":  # a row was not acknowledged: the cursor moved less
        source[0] = Cursor(7, "10:10:", "12:12:", 4)
    elif change == "token":  # the lane was lost and taken again
        lanes[1], source[1] = 8, 8
    elif change == "lanes":
        del lanes[1], source[1]
    else:  # the server restarted after a crash
        incarnation = "other"
    assert ahead.take(lanes, source, incarnation) is None


def test_a_read_that_failed_is_none_and_the_caller_reads_again(ahead: ReadAhead) -> None:
    def fail(source: object) -> Claimed:
        raise RuntimeError("the database went away")

    ahead.start(fail, LANES, SOURCE, "inc")
    assert ahead.take(LANES, SOURCE, "inc") is None


def test_drop_waits_for_the_read_so_that_claims_never_overlap(ahead: ReadAhead) -> None:
    release, done = threading.Event(), threading.Event()

    def slow(source: object) -> Claimed:
        release.wait(5)
        done.set()
        return batch()

    ahead.start(slow, LANES, SOURCE, "inc")
    threading.Timer(0.2, release.set).start()
    ahead.drop()
    assert done.is_set()
    assert ahead.take(LANES, SOURCE, "inc") is None
