"""A relay gives lanes back between batches, never while a batch of theirs is being recorded
(the record runs on the marking thread while the loop goes on): the new owner would read the
batch's rows from a cursor not moved yet and send them again."""

from __future__ import annotations

import threading
import time

import pytest

from relay.daemon import Relay
from relay.settings import RelaySettings


def test_lanes_are_given_back_only_after_the_batch_being_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay = Relay(RelaySettings(database_url="postgresql://u@127.0.0.1:1/x",
                                kafka_bootstrap="127.0.0.1:1"))
    recorded = threading.Event()

    def slow_record() -> None:
        time.sleep(0.3)
        recorded.set()

    seen: list[bool] = []
    monkeypatch.setattr(relay.lanes, "release_pending", lambda: seen.append(recorded.is_set()))
    relay.lanes._to_release = {3}
    relay._marking = relay._marker.submit(slow_record)
    try:
        relay._give_back_excess()
    finally:
        relay._marker.shutdown(wait=True)
    assert seen == [True]


def test_nothing_waits_when_no_lane_is_to_be_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    relay = Relay(RelaySettings(database_url="postgresql://u@127.0.0.1:1/x",
                                kafka_bootstrap="127.0.0.1:1"))
    gate = threading.Event()
    relay._marking = relay._marker.submit(gate.wait, 5)
    monkeypatch.setattr(relay.lanes, "release_pending", lambda: pytest.fail("nothing to give"))
    try:
        relay._give_back_excess()
        assert relay._marking is not None  # the next batch is read beside the record
    finally:
        gate.set()
        relay._marker.shutdown(wait=True)


def test_a_light_batch_the_database_refuses_is_recorded_by_the_marking_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While idle the record runs on the loop's thread, one try only: during an outage the
    # loop must go on (beating, backing off), and the marking thread keep trying.
    from psycopg import OperationalError  # noqa: PLC0415

    relay = Relay(RelaySettings(database_url="postgresql://u@127.0.0.1:1/x",
                                kafka_bootstrap="127.0.0.1:1"))
    calls: list[tuple[bool, str]] = []

    def record(*_: object, retry: bool = True, **__: object) -> None:
        calls.append((retry, threading.current_thread().name))
        if not retry:
            raise OperationalError("server closed the connection")

    monkeypatch.setattr(relay, "_record", record)
    try:
        marking = relay._mark_here(([], [], [], {}), False, None, {})
        marking.result(timeout=5)
    finally:
        relay._marker.shutdown(wait=True)
    assert calls[0] == (False, threading.current_thread().name)  # tried here, once
    assert calls[1][0] is True  # then handed over: the marking thread retries
    assert calls[1][1].startswith("relay-mark")
