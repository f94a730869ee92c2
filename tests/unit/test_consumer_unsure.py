"""Which partitions' first records the runner asks the failures table about (Runner._unsure):
those that do not follow the last batch read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from consumers.runner import Runner
from outbox.kafka import Record


def rec(topic: str, partition: int, offset: int) -> Record:
    return Record(topic, partition, offset, 0, None, b"{}", [])


def unsure(state: Any, records: list[Record]) -> list[tuple[str, int, int]]:
    """The positions asked about, in no particular order (a set is asked)."""
    return sorted(Runner._unsure(state, records))


def test_first_records_of_partitions_not_following_the_last_batch() -> None:
    state = SimpleNamespace(_next={})
    batch = [rec("a", 0, 5), rec("b", 1, 9), rec("a", 0, 6), rec("a", 1, 3), rec("b", 1, 10)]
    # Nothing read before: each partition's first record.
    assert unsure(state, batch) == [("a", 0, 5), ("a", 1, 3), ("b", 1, 9)]
    assert state._next == {("a", 0): 7, ("b", 1): 11, ("a", 1): 4}
    # Following on: none; a partition read again from elsewhere (a rewind): that one.
    assert unsure(state, [rec("b", 1, 11), rec("a", 0, 2), rec("a", 0, 3)]) == [("a", 0, 2)]
    assert state._next == {("a", 0): 4, ("b", 1): 12, ("a", 1): 4}
