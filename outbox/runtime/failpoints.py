"""Named failpoints: places where a test can make this process crash, fail or stall.

Off by default and nearly free when off (one dict lookup on an empty dict). Switched on by
``OUTBOXKIT_FAILPOINTS``, a ``;``-separated list of ``name=action[trigger]``:

    relay.after_ack=kill@37            SIGKILL this process on the 37th hit
    relay.after_send=raise%0.2         raise FailpointTriggered on 20 % of hits
    consumer.after_db_commit=sleep(500)  sleep 500 ms on every hit
    ...;seed=7                         seed for the probabilities (repeatable runs)

Actions: ``kill`` (SIGKILL itself: no cleanup, like a power cut), ``raise``
(:class:`FailpointTriggered`), ``sleep(MS)``. Triggers: ``@N`` (the Nth hit only), ``%P``
(each hit with probability P), none (every hit). The names in :data:`FAILPOINTS` are the
ones the code has; ``docs/failpoints.md`` lists them and a test keeps the two in sync.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass

# Every failpoint in the code, with where it sits. A test checks each is reachable in the
# source and documented.
FAILPOINTS: dict[str, str] = {
    "outbox.after_checkpoint": "a checkpoint was written in the caller's transaction, "
    "before it commits",
    "outbox.before_emit": "a message is about to be written in the caller's transaction",
    "relay.after_send": "a batch was handed to the producer, before any acknowledgement",
    "relay.after_ack": "Kafka acknowledged a batch, before the rows are marked published",
    "relay.after_mark": "a batch's rows were marked published (on the marking thread; the "
    "next batch may already be in flight)",
    "consumer.after_handler": "the handler ran in the message's transaction, before it "
    "commits",
    "consumer.after_db_commit": "the handler's writes and dedup marks committed, before the "
    "Kafka offsets are committed",
    "consumer.leave_group": "the consumer's loop went round (raise: its Kafka client "
    "leaves the group behind the loop's back, a stall the watchdog must notice)",
    "consumer.stuck_fetch": "the consumer's loop went round (raise: from then on the "
    "loop's polls of this Kafka client return nothing, as a client whose fetches are stuck; "
    "the watchdog must notice)",
    "operations.after_call": "the outside system was called, before its answer is recorded",
    "agent.before_response_commit": "a durable agent got a model response, before the "
    "checkpoint that records it commits",
    "agent.after_response_commit": "a model response's checkpoint committed, before its tool "
    "calls run",
    "agent.before_effect_commit": "an effect tool's message and the move to waiting were "
    "written, before they commit",
    "agent.after_effect_commit": "an effect tool's message and the move to waiting committed",
    "agent.after_confirmation": "a resumed agent recorded its effect's confirmed result, "
    "before the agent goes on",
}

_SPEC = re.compile(
    r"^(?P<name>[a-z_.]+)=(?P<action>kill|raise|sleep\((?P<ms>\d+)\))"
    r"(?:@(?P<nth>\d+)|%(?P<p>0?\.\d+|1(?:\.0*)?))?$"
)


class FailpointTriggered(Exception):
    """Raised by a ``raise`` failpoint. Deliberately outside the OutboxError tree."""

    def __init__(self, name: str) -> None:
        super().__init__(f"failpoint {name} triggered")
        self.name = name


@dataclass
class _Point:
    action: str
    sleep_ms: int
    nth: int | None
    probability: float | None
    hits: int = 0


def parse(spec: str) -> tuple[dict[str, _Point], int]:
    """Parse an OUTBOXKIT_FAILPOINTS value; unknown names and bad syntax are errors."""
    points: dict[str, _Point] = {}
    seed = 0
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        if part.startswith("seed="):
            seed = int(part.removeprefix("seed="))
            continue
        match = _SPEC.match(part)
        if not match:
            raise ValueError(f"bad failpoint {part!r}: expected name=kill|raise|sleep(MS)"
                             "[@N|%P]")
        name = match["name"]
        if name not in FAILPOINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(FAILPOINTS))}")
        action = "sleep" if match["ms"] else match["action"]
        points[name] = _Point(action, int(match["ms"] or 0),
                              int(match["nth"]) if match["nth"] else None,
                              float(match["p"]) if match["p"] else None)
    return points, seed


_ACTIVE, _SEED = parse(os.environ.get("OUTBOXKIT_FAILPOINTS", ""))
_RNG = random.Random(_SEED)  # noqa: S311 - repeatable fault injection, not secrecy
_LOCK = threading.Lock()


def failpoint(name: str) -> None:
    """Crash, fail or stall here if the failpoint *name* is switched on for this process."""
    point = _ACTIVE.get(name)
    if point is None:
        return
    with _LOCK:
        point.hits += 1
        if point.nth is not None and point.hits != point.nth:
            return
        if point.probability is not None and _RNG.random() >= point.probability:
            return
    if point.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # SIGKILL is asynchronous; never run past the failpoint
    elif point.action == "raise":
        raise FailpointTriggered(name)
    else:
        time.sleep(point.sleep_ms / 1000)
