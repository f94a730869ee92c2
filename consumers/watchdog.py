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
* **no assignment while the group's backlog stands still**: nothing assigned, the group's
  committed offsets behind the high watermarks, and not moving (a member of a group with
  more members than partitions is idle on purpose: its peers' commits move, or there is
  nothing to read). The group is asked through the admin client, once per check, only
  while nothing is assigned.

Either state held for ``watchdog_session_timeouts`` session timeouts is a stall. The
consumer then reports not-ready (``/readyz``), and if the brokers answer a metadata request
it rebuilds its Kafka client (what is done is committed first, the partitions given up
like a revocation); if they do not, rebuilding would not help, and the check repeats. The
state is pure logic over what the loop reports, so it is tested without a broker; the
runner (:mod:`consumers.runner`) does the asking and the rebuilding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from outbox.kafka import TopicPartition

# The group's committed offsets and its backlog (sum of high watermark - committed), or
# None when the brokers did not answer.
GroupView = tuple[Mapping[TopicPartition, int], int]


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
        group: the group's committed offsets and backlog, or None if the brokers did not
            answer (called on the loop's thread, at most every ``check_every_s``).
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
        self._behind_seen = 0  # the brokers' last answer to ``behind``
        self._since: float | None = None  # when the stall began (None: working or idle)
        self._why = ""
        self._next_check = 0.0
        self._committed: Mapping[TopicPartition, int] | None = None

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
            self._committed = None  # the group check starts afresh when unassigned again
            if waiting <= 0:
                waiting = self._ask_behind(now)
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
        self._since, self._why, self._committed = None, "", None
        self._behind_seen = 0
        return WORKING

    def _ask_behind(self, now: float) -> int:
        """What the brokers say waits on the assigned partitions (between checks: what they
        said last; no answer: nothing known to wait)."""
        if now >= self._next_check:
            self._next_check = now + self.check_every_s
            found = self._behind()
            self._behind_seen = 0 if found is None else found
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
            return self._stalling(now, "no partitions assigned, and the brokers do not "
                                       "answer") if self._since is not None else UNSURE
        committed, backlog = view
        moved = self._committed is not None and dict(committed) != dict(self._committed)
        self._committed = dict(committed)
        if backlog <= 0 or moved:
            self._since, self._why = None, ""  # nothing to read, or the group reads it
            return WORKING
        return self._stalling(now, f"no partitions assigned while the group's {backlog} "
                                   "record(s) wait unread")
