"""Clean batches' records written together at light traffic (relay/grouped.py)."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime

import pytest

from relay.claims import OutboxRow, Published
from relay.cursors import Cursor
from relay.grouped import Held

A = uuid.uuid4()


def published(row_id: int, lane: int) -> Published:
    row = OutboxRow(row_id, uuid.uuid4(), "t", b"k", "t", b"{}", {}, datetime.now(UTC), lane, 0)
    return Published(row, 0, row_id)


def held() -> Held:
    return Held([published(1, 3), published(2, 4)],
                {3: (Cursor(7, "10:10:", "12:12:", 1), 1), 4: (Cursor(8, "10:10:", None, 0), 1)},
                A, {3: 7, 4: 8}, due=0.0)


def test_a_batch_read_under_the_same_incarnation_and_tokens_joins() -> None:
    assert held().takes(A, {3: 7})
    assert held().takes(A, {3: 7, 5: 2})  # a lane not in the record yet


def test_a_lane_taken_again_or_another_incarnation_does_not_join() -> None:
    assert not held().takes(A, {3: 9})  # lane 3 acquired again since: another token
    assert not held().takes(uuid.uuid4(), {3: 7})
    assert not held().takes(None, {3: 7})


def test_a_later_batch_adds_its_proofs_and_moves_the_cursors_on() -> None:
    group = held()
    later = Cursor(7, "10:10:", "12:12:", 5)
    group.add([published(5, 3), published(6, 5)], {3: (later, 2), 5: (Cursor(2, "9:9:"), 1)},
              {3: 7, 5: 2})
    assert [p.row.id for p in group.published] == [1, 2, 5, 6]
    assert group.moves[3] == (later, 3)  # the latest cursor, every row of the lane counted
    assert group.moves[4][1] == 1
    assert group.moves[5] == (Cursor(2, "9:9:"), 1)
    assert group.tokens == {3: 7, 4: 8, 5: 2}


def test_a_due_group_the_database_refuses_leaves_the_loop_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Written once due from the loop's wait, one try there; refused, the marking thread keeps
    # trying while the loop goes on beating (a light batch's record does the same).
    from psycopg import OperationalError  # noqa: PLC0415

    from relay.daemon import Relay  # noqa: PLC0415
    from relay.settings import RelaySettings  # noqa: PLC0415

    relay = Relay(RelaySettings(database_url="postgresql://u@127.0.0.1:1/x",
                                kafka_bootstrap="127.0.0.1:1"))
    gate = threading.Event()
    calls: list[tuple[int, bool]] = []

    def record(published: list[Published], *_: object, retry: bool = True,
               **__: object) -> None:
        calls.append((len(published), retry))
        if not retry:
            raise OperationalError("server closed the connection")
        gate.wait(5)

    monkeypatch.setattr(relay, "_record", record)
    relay._held = held()
    try:
        started = time.monotonic()
        relay._record_due()
        assert time.monotonic() - started < 1  # not waiting for the database
        assert relay._held is None
        assert relay._marking is not None
        assert not relay._marking.done()
        gate.set()
        assert relay._finish_marking()
    finally:
        gate.set()
        relay._marker.shutdown(wait=True)
    assert calls == [(2, False), (2, True)]  # both proofs, tried here then by the thread


def test_a_group_not_due_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from relay.daemon import Relay  # noqa: PLC0415
    from relay.settings import RelaySettings  # noqa: PLC0415

    relay = Relay(RelaySettings(database_url="postgresql://u@127.0.0.1:1/x",
                                kafka_bootstrap="127.0.0.1:1"))
    monkeypatch.setattr(relay, "_record", lambda *_, **__: pytest.fail("not due yet"))
    relay._held = held()
    relay._held.due = time.monotonic() + 60
    relay._record_due()
    assert relay._held is not None
    relay._marker.shutdown(wait=True)
