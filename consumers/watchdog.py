"""The consumer's watchdog: a Kafka client that is alive but no longer works is rebuilt.

A consumer can answer its liveness probe (its loop goes round, its polls return) and still
do nothing for minutes: a librdkafka client that lost its partitions while the brokers were
away may keep a coordinator request hanging and never rejoin its group (librdkafka #5153),
and a client whose fetches are stuck returns empty polls while records wait. The loop
cannot tell such a client from an idle one by itself, so the watchdog looks for the
difference:

* **assigned, records waiting, nothing read**: partitions assigned, records behind their
  high watermarks on partitions the loop has not paused itself, and no record read nor
  batch handled. The client's own high watermarks come with its fetch responses, so a
  client that stopped fetching stops seeing new records: when it says nothing waits and
  nothing was read, the brokers' end offsets are asked (at most once per check);
* **out of its group**: nothing assigned, and the group, as its coordinator describes it,
  is stable without this client among its members, or has no member at all. A member of a
  group with more members than partitions is idle on purpose (stable, and a member); one
  whose group is rebalancing is joining. The coordinator is asked, once per check, only
  while nothing is assigned.

Either state held for ``watchdog_session_timeouts`` session timeouts is a stall. The
consumer then reports not-ready (``/readyz``), and if the brokers answer a metadata request
it rebuilds its Kafka client (the partitions given up like a revocation; the offsets not
yet committed are not asked of the stuck client, so their messages come again and the
dedup marks drop them); if they do not, rebuilding would not help, and the check repeats. The
state is pure logic over what the loop reports, so it is tested without a broker; the
runner (:mod:`consumers.runner`) does the asking and the rebuilding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# The group's state as its coordinator says it (outbox.kafka.api.group_state) and whether
# this client is among its members; None when the brokers did not answer.
GroupView = tuple[str, bool]


@dataclass(frozen=True)
class Verdict:
    """What the loop should do now: rebuild the client (*stalled*, with the *reason*), or
    nothing; *working*: the client is known to work (read or handled something, is caught
    up, or is idle in a group that reads), so a stall reported before is over."""

    stalled: bool
    reason: str = ""
    working: bool = False


UNSURE = Verdict(False)  # no stall yet, no proof of work either
WORKING = Verdict(False, working=True)


class Watchdog:
    """Tracks since when the consumer has not worked although it had work.

    Args:
        after_s: how long a stall lasts before it counts (N session timeouts).
        check_every_s: how often the group is asked while nothing is assigned.
        group: the group's state and whether this client is a member, or None if the
            brokers did not answer (called on the loop's thread, at most every
            ``check_every_s``).
        behind: records waiting on the client's assigned, unpaused partitions by the
            brokers' end offsets, or None if they did not answer (likewise).
        clock: ``time.monotonic`` (a test's own clock otherwise).
    """

    def __init__(self, *, after_s: float, check_every_s: float,
                 group: Callable[[], GroupView | None],
                 behind: Callable[[], int | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s, self.check_every_s = after_s, check_every_s
        self._group, self._behind, self._clock = group, behind, clock
        self._behind_seen: int | None = 0  # the brokers' last answer to ``behind``
        self._since: float | None = None  # when the stall began (None: working or idle)
        self._why = ""
        self._next_check = 0.0

    @property
    def enabled(self) -> bool:
        return self.after_s > 0

    @property
    def stalled_for(self) -> float:
        """Seconds the current stall has lasted (0 when there is none)."""
        return 0.0 if self._since is None else self._clock() - self._since

    def observe(self, *, assigned: int, waiting: int, progressed: bool) -> Verdict:
        """One turn of the loop: *assigned* partitions, *waiting* records behind the high
        watermarks of assigned partitions the loop has not paused, whether any record was
        read or batch handled since the last turn."""
        if not self.enabled:
            return WORKING
        now = self._clock()
        if progressed:
            return self._working()
        if assigned:
            if waiting <= 0:
                found = self._ask_behind(now)
                if found is None:  # the brokers do not answer: nothing is known
                    return self._unsure(now, "records may wait, and the brokers do not answer")
                waiting = found
            if waiting <= 0:
                return self._working()  # caught up: idle, not stalled
            return self._stalling(now, f"{waiting} record(s) waiting on assigned partitions "
                                       "and none read")
        return self._unassigned(now)

    def rebuilt(self) -> None:
        """The client was rebuilt: the new one gets the whole delay again."""
        self._working()
        self._next_check = 0.0

    def _working(self) -> Verdict:
        self._since, self._why = None, ""
        self._behind_seen = 0
        return WORKING

    def _unsure(self, now: float, why: str) -> Verdict:
        """Nothing proves work, nothing proves a stall: a stall already counted goes on
        (a client that stalled does not recover because the brokers went away too)."""
        return self._stalling(now, why) if self._since is not None else UNSURE

    def _ask_behind(self, now: float) -> int | None:
        """What the brokers say waits on the assigned partitions (between checks: what they
        said last); None if they did not answer."""
        if now >= self._next_check:
            self._next_check = now + self.check_every_s
            self._behind_seen = self._behind()
        return self._behind_seen

    def _stalling(self, now: float, why: str) -> Verdict:
        if self._since is None:
            self._since = now
        self._why = why
        if now - self._since >= self.after_s:
            return Verdict(True, f"{why} for {now - self._since:.0f} s")
        return UNSURE

    def _unassigned(self, now: float) -> Verdict:
        if now < self._next_check:
            # Between checks the last answer stands.
            return self._stalling(now, self._why) if self._since is not None else UNSURE
        self._next_check = now + self.check_every_s
        view = self._group()
        if view is None:
            return self._unsure(now, "no partitions assigned, and the brokers do not answer")
        state, member = view
        if state == "stable" and member:
            return self._working()  # idle on purpose
        if state == "rebalancing":
            # Joining: no stall, but no proof of work either (a rebuilt client joins at
            # once, and is ready again only when it reads or is given nothing to read).
            self._since, self._why = None, ""
            return UNSURE
        if state in ("stable", "empty", "dead"):
            return self._stalling(now, f"no partitions assigned, and the group ({state}) "
                                       "does not count this client among its members")
        return self._unsure(now, f"no partitions assigned; the group's state is {state}")
