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
"""

from __future__ import annotations

import logging
import threading

import psycopg

from outbox.backoff import Backoff
from outbox.db.dsn import connect_args
from outbox.db.queries import quote_identifier

log = logging.getLogger(__name__)

# The LISTEN connection's reconnect pauses: 0.2 s doubling up to 10 s, reset once connected.
# No jitter: one connection per relay, and the fallback poll covers the gap.
RECONNECT = Backoff(base=0.2, cap=10.0)


class WakeUp:
    """Why the relay should look again: the lanes notifications named, or everything."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._lanes: set[int] = set()
        self._everything = False

    def lane(self, lane: int) -> None:
        with self._lock:
            self._lanes.add(lane)
            self._event.set()

    def everywhere(self) -> None:
        """Look at every lane (the fallback poll, lanes acquired, stopping)."""
        with self._lock:
            self._everything = True
            self._event.set()

    def take(self) -> set[int] | None:
        """The lanes named since the last take, or None for every lane; resets both."""
        with self._lock:
            lanes, everything = self._lanes, self._everything
            self._lanes, self._everything = set(), False
            self._event.clear()
        return None if everything else lanes

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def is_set(self) -> bool:
        return self._event.is_set()


class Listener:
    """A thread that LISTENs on the outbox channel and sets *wake* on every notification.

    It reconnects by itself with a growing pause; while it is down the fallback poll
    still wakes the relay, only later.
    """

    def __init__(self, dsn: str, channel: str, wake: WakeUp) -> None:
        self._dsn = dsn
        self._channel = channel
        self._wake = wake
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, **connect_args(self._dsn)) as conn:
                    # LISTEN takes no parameter: the channel is an identifier, quoted by
                    # the one rule (pg_notify's text argument names the same channel).
                    conn.execute(f"LISTEN {quote_identifier(self._channel)}")
                    self.connected.set()
                    if failures:
                        # What was committed while no one listened notified no one (after a
                        # failover, on another server): look everywhere once.
                        self._wake.everywhere()
                    failures = 0
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5, stop_after=1):
                            self._heard(note.payload)
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

    def _heard(self, payload: str) -> None:
        # Emits send the row's lane; anything else (another sender) means look everywhere.
        try:
            self._wake.lane(int(payload))
        except ValueError:
            self._wake.everywhere()
