"""The relay's loop waits on its LISTEN connection's socket (relay/wakeup.py): what a real
PostgreSQL sends wakes it with the lanes named, and a LISTEN connection that breaks makes it
look everywhere and is connected again by the listener's thread."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from relay.wakeup import Listener, WakeUp

CHANNEL = "outboxkit_test_listen"


@pytest.fixture
def listening(database_url: str) -> Iterator[tuple[WakeUp, Listener]]:
    wake = WakeUp()
    listener = Listener(database_url, CHANNEL, wake)
    listener.start()
    assert listener.connected.wait(10)
    try:
        yield wake, listener
    finally:
        listener.stop()
        wake.close()


def notify(database_url: str, payload: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))


def test_a_notification_wakes_the_wait_with_its_lane(
    database_url: str, listening: tuple[WakeUp, Listener]
) -> None:
    wake, _ = listening
    assert not wake.wait(0.05)
    notify(database_url, "12")
    notify(database_url, "40")
    assert wake.wait(10)
    deadline = time.monotonic() + 10
    named: set[int] = set()
    while named != {12, 40} and time.monotonic() < deadline:
        taken = wake.take()
        assert taken is not None
        named |= taken
        wake.wait(0.1)
    assert named == {12, 40}
    notify(database_url, "not a lane")
    assert wake.wait(10)
    assert wake.take() is None  # someone else's NOTIFY: look everywhere


def test_notifications_that_arrive_while_the_loop_is_busy_are_read_at_its_next_take(
    database_url: str, listening: tuple[WakeUp, Listener]
) -> None:
    wake, _ = listening
    notify(database_url, "3")
    time.sleep(0.2)  # the loop is claiming, say: nobody waits on the socket
    assert wake.is_set()
    assert wake.take() == {3}


def test_a_broken_listen_connection_looks_everywhere_and_is_connected_again(
    database_url: str, listening: tuple[WakeUp, Listener]
) -> None:
    wake, listener = listening
    with psycopg.connect(database_url, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE query LIKE 'LISTEN%%' AND datname = current_database()"
        ).fetchall()
    assert killed == [(True,)]
    assert wake.wait(10)
    assert wake.take() is None  # what was committed meanwhile notified no one here
    deadline = time.monotonic() + 15
    heard: set[int] | None = set()
    while not heard and time.monotonic() < deadline:  # connected again after its pause
        notify(database_url, "9")
        if wake.wait(0.5):
            heard = wake.take()
    assert heard is not None
    assert 9 in heard
    assert listener.connected.is_set()
