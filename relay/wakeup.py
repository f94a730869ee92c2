"""Waking an idle relay on commit without making busy commits pay for NOTIFY.

A transaction that NOTIFYs takes a database-wide lock at commit, so emits notify only
while some relay has declared itself idle (``relays.idle``), which they read in the same
statement as their INSERT. The relay declares itself idle only after a claim came back
empty, re-checks once after declaring, and then waits for a notification or for the
fallback poll, whichever comes first. A notification lost in the gap between an emit's
INSERT and the relay's declaration is covered by that poll.

The notification names the row's lane. While the relay is idle, every commit notifies, so a
wake-up by notifications alone needs a look at the lanes they named, not at all 64: at light
traffic a claim reads one lane. Anything else (the fallback poll, lanes newly acquired, a
relay that is not idle) looks at every lane.

Flipping the flag leaves ``heartbeat_at`` alone: only the lane heartbeat, which renews the
relay's leases in the same transaction, may say the relay is alive. A relay killed right
after flipping would otherwise look alive for a lease after its lanes ran out, and the
others would wait that long before taking them (their fair share still counted it).

The relay's loop waits on the LISTEN connection's socket itself (with a pipe that the other
threads write to when they wake it). A thread that received the notifications and then woke
the loop cost a thread's wake-up and sleep per commit plus the loop's own, and on these
machines that was a tenth of a light-traffic relay's CPU. The listener's thread now only
connects (again), LISTENs and hands the connection over; it also reads what arrived every
half second, so a loop that is busy elsewhere (a long back-off) never leaves the server's
notification queue waiting on an unread socket.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.backoff import Backoff
from outbox.db.dsn import connect_args
from outbox.db.queries import quote_identifier

log = logging.getLogger(__name__)

# The LISTEN connection's reconnect pauses: 0.2 s doubling up to 10 s, reset once connected.
# No jitter: one connection per relay, and the fallback poll covers the gap.
RECONNECT = Backoff(base=0.2, cap=10.0)

# How often the listener's thread reads notifications the loop has not read yet.
DRAIN_EVERY_S = 0.5


class WakeUp:
    """Why the relay should look again: the lanes notifications named, or everything.

    Other threads call :meth:`lane` and :meth:`everywhere`; the loop calls :meth:`wait`,
    :meth:`is_set` and :meth:`take`, which also read the LISTEN connection attached to it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lanes: set[int] = set()
        self._everything = False
        # A byte in the pipe wakes the loop's poll(); at most one is ever unread.
        self._read_end, self._write_end = os.pipe()
        os.set_blocking(self._read_end, False)
        os.set_blocking(self._write_end, False)
        self._signalled = False
        self._closed = False
        self._pgconn: Any = None  # the LISTEN connection's libpq connection, once attached
        self._lost: Callable[[psycopg.Error], None] | None = None

    def lane(self, lane: int) -> None:
        with self._lock:
            self._lanes.add(lane)
            self._signal()

    def everywhere(self) -> None:
        """Look at every lane (the fallback poll, lanes acquired, stopping)."""
        with self._lock:
            self._everything = True
            self._signal()

    def take(self) -> set[int] | None:
        """The lanes named since the last take, or None for every lane; resets both."""
        with self._lock:
            self._read()
            lanes, everything = self._lanes, self._everything
            self._lanes, self._everything = set(), False
            self._unsignal()
        return None if everything else lanes

    def wait(self, timeout: float) -> bool:
        """Until something is named or *timeout* passes; True when something was."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._read()
                if self._lanes or self._everything:
                    return True
                self._unsignal()  # a bare wake-up (attach, detach): wait on
                watched = [self._read_end]
                if self._pgconn is not None:
                    watched.append(self._pgconn.socket)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # poll(), not select(): no limit on the descriptors' numbers.
            poller = select.poll()
            for fd in watched:
                poller.register(fd, select.POLLIN)
            poller.poll(left * 1000)  # a socket closed under us: detach wrote to the pipe

    def is_set(self) -> bool:
        with self._lock:
            self._read()
            return bool(self._lanes or self._everything)

    def attach(self, pgconn: Any, lost: Callable[[psycopg.Error], None]) -> None:
        """Read notifications from *pgconn* (LISTENing); call *lost* if it breaks."""
        with self._lock:
            self._pgconn, self._lost = pgconn, lost
            self._signal()  # a loop already waiting watches it from now on

    def detach(self) -> None:
        with self._lock:
            self._pgconn = self._lost = None
            self._signal()  # a loop waiting on its socket lets go of it before it is closed

    def read(self) -> None:
        """Read the notifications that arrived (the listener's thread, now and then)."""
        with self._lock:
            self._read()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read_end)
                os.close(self._write_end)

    def _signal(self) -> None:
        if not self._signalled and not self._closed:
            self._signalled = True
            os.write(self._write_end, b"\0")

    def _unsignal(self) -> None:
        if self._signalled and not self._closed:
            self._signalled = False
            os.read(self._read_end, 64)

    def _read(self) -> None:
        pgconn = self._pgconn
        if pgconn is None:
            return
        try:
            pgconn.consume_input()
        except psycopg.Error as exc:
            # Broken: what was committed meanwhile notified no one here. Look everywhere,
            # and let the listener's thread connect again.
            lost = self._lost
            self._pgconn = self._lost = None
            self._everything = True
            self._signal()
            if lost is not None:
                lost(exc)
            return
        while (note := pgconn.notifies()) is not None:
            self._heard(note.extra.decode())

    def _heard(self, payload: str) -> None:
        # Emits send the row's lane; anything else (another sender) means look everywhere.
        try:
            self._lanes.add(int(payload))
        except ValueError:
            self._everything = True


class Listener:
    """A thread that keeps a LISTEN connection on the outbox channel attached to *wake*.

    It reconnects by itself with a growing pause; while it is down the fallback poll
    still wakes the relay, only later.
    """

    def __init__(self, dsn: str, channel: str, wake: WakeUp) -> None:
        self._dsn = dsn
        self._channel = channel
        self._wake = wake
        self._stop = threading.Event()
        self._nudge = threading.Event()  # stop, or the loop found the connection broken
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._nudge.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, **connect_args(self._dsn)) as conn:
                    # LISTEN takes no parameter: the channel is an identifier, quoted by
                    # the one rule (pg_notify's text argument names the same channel).
                    conn.execute(f"LISTEN {quote_identifier(self._channel)}")
                    self._listen(conn, again=failures > 0)
                    failures = 0
            except psycopg.Error as exc:
                self.connected.clear()
                failures += 1
                pause = RECONNECT.delay(failures)
                log.warning(
                    "LISTEN connection lost (%s); retrying in %.1f s",
                    (str(exc).splitlines() or [type(exc).__name__])[0],
                    pause,
                    extra={"event": "relay.listen_lost"},
                )
                self._stop.wait(pause)
        self.connected.clear()

    def _listen(self, conn: psycopg.Connection[Any], *, again: bool) -> None:
        """Hand *conn* to the loop until it breaks (raised) or the relay stops."""
        self._nudge.clear()
        broken: list[psycopg.Error] = []

        def lost(exc: psycopg.Error) -> None:
            broken.append(exc)
            self._nudge.set()

        self._wake.attach(conn.pgconn, lost)
        self.connected.set()
        if again:
            # What was committed while no one listened notified no one (after a failover,
            # on another server): look everywhere once.
            self._wake.everywhere()
        try:
            while not self._stop.is_set() and not broken:
                if not self._nudge.wait(DRAIN_EVERY_S):
                    self._wake.read()
        finally:
            self._wake.detach()
        if broken:
            raise broken[0]
