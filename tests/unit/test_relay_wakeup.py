"""What wakes the relay: the lanes notifications named, or everything (pure logic)."""

from __future__ import annotations

import threading
import time

from relay.wakeup import WakeUp


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
    wake._heard("12")
    assert wake.take() == {12}
    wake._heard("hello")  # a NOTIFY from someone else on the channel
    assert wake.take() is None


def test_wait_returns_when_another_thread_names_a_lane_and_not_before() -> None:
    wake = WakeUp()
    threading.Timer(0.05, wake.lane, (4,)).start()
    assert wake.wait(5.0)
    assert wake.take() == {4}
    started = time.monotonic()
    assert not wake.wait(0.1)  # nothing named: the whole timeout
    assert time.monotonic() - started >= 0.09


def test_a_bare_wake_up_does_not_end_the_wait_nor_make_it_spin() -> None:
    """Attaching or detaching the LISTEN connection wakes a waiting loop (to watch the new
    socket, or let go of the old one) without naming anything: the wait goes on, asleep."""
    wake = WakeUp()
    wake.detach()
    cpu, started = time.thread_time(), time.monotonic()
    assert not wake.wait(0.2)
    assert time.monotonic() - started >= 0.19
    assert time.thread_time() - cpu < 0.1  # spinning would burn the whole 0.2 s


def test_waking_a_closed_wake_up_is_harmless() -> None:
    wake = WakeUp()
    wake.close()
    wake.everywhere()  # a signal handler's stop() after the relay shut down
    wake.close()
