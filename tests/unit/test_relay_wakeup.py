"""What wakes the relay: the lanes notifications named, or everything (pure logic)."""

from __future__ import annotations

from relay.wakeup import Listener, WakeUp


def test_notifications_name_lanes_and_taking_them_resets() -> None:
    wake = WakeUp()
    assert not wake.is_set()
    wake.lane(3)
    wake.lane(7)
    wake.lane(3)
    assert wake.is_set()
    assert wake.take() == {3, 7}
    assert not wake.is_set()
    assert wake.take() == set()  # nothing named since


def test_everywhere_wins_over_named_lanes_until_taken() -> None:
    wake = WakeUp()
    wake.lane(1)
    wake.everywhere()  # the fallback poll: every lane
    wake.lane(2)
    assert wake.take() is None
    wake.lane(5)
    assert wake.take() == {5}


def test_a_payload_that_is_not_a_lane_looks_everywhere() -> None:
    wake = WakeUp()
    listener = Listener("postgresql://unused", "outboxkit", wake)
    listener._heard("12")
    assert wake.take() == {12}
    listener._heard("hello")  # a NOTIFY from someone else on the channel
    assert wake.take() is None
