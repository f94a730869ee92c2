"""The dedup window rule: marks must outlive every redelivery Kafka can still make.

A message can be delivered again as long as it is in the topic (its retention) and a
consumer has not committed past it (its lag). Purging the mark before both have passed is
how duplicates come back (Wolverine #1725), so a shorter window is refused up front.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from outbox.errors import ConfigurationError

KEEP_FOREVER = 0.0

# Largest first: a duration reads in its largest unit, plus the next one down if not zero.
_UNITS = ((86_400, "day"), (3_600, "h"), (60, "min"), (1, "s"))


def human_duration(seconds: float) -> str:
    """*seconds* as people read them: ``31 days``, ``2 h 5 min``, ``1 day 1 h``, ``0.5 s``.

    Two units at most, rounded down to the second: enough to compare figures at a glance.
    Where the exact figure matters (a value to type into a setting), print the seconds too.
    """
    if seconds < 0:
        return f"-{human_duration(-seconds)}"
    if round(seconds, 1) < 60:
        return f"{round(seconds, 1):g} s"
    left = round(seconds)
    for index, (size, name) in enumerate(_UNITS):
        if left < size:
            continue
        count, rest = divmod(left, size)
        text = _counted(count, name)
        if index + 1 < len(_UNITS):
            next_size, next_name = _UNITS[index + 1]
            if rest // next_size:
                text += " " + _counted(rest // next_size, next_name)
        return text
    raise AssertionError("unreachable: at least a minute has a unit")


def _counted(count: int, unit: str) -> str:
    return f"{count} {unit}s" if unit == "day" and count != 1 else f"{count} {unit}"


def required_window(topic_retention_s: float | None, max_lag_s: float) -> float | None:
    """The shortest safe dedup window, or None when the topic keeps messages forever."""
    if topic_retention_s is None or topic_retention_s < 0:
        return None
    return topic_retention_s + max_lag_s


def check_window(
    dedup_retention_s: float,
    topic_retention_s: Mapping[str, float | None],
    max_lag_s: float,
) -> None:
    """Raise :class:`ConfigurationError` unless marks outlive every topic's redeliveries.

    Args:
        dedup_retention_s: how long marks are kept; 0 keeps them forever (always safe).
        topic_retention_s: per topic, its ``retention.ms`` in seconds (None: unlimited).
        max_lag_s: the longest a consumer may fall behind (the lag setting).
    """
    if dedup_retention_s == KEEP_FOREVER:
        return
    for topic, retention in sorted(topic_retention_s.items()):
        needed = required_window(retention, max_lag_s)
        if needed is None or retention is None:
            raise ConfigurationError(
                f"dedup retention of {human_duration(dedup_retention_s)} is unsafe for topic "
                f"{topic!r}, which keeps messages forever (retention.ms=-1): set the dedup "
                "retention to 0 (keep marks forever) or give the topic a retention"
            )
        if dedup_retention_s < needed:
            raise ConfigurationError(
                f"dedup retention of {human_duration(dedup_retention_s)} is shorter than topic "
                f"{topic!r}'s retention ({human_duration(retention)}) plus the max consumer "
                f"lag ({human_duration(max_lag_s)}): marks would be purged while Kafka can "
                f"still redeliver; set it to at least {math.ceil(needed)} s "
                f"({human_duration(needed)})"
            )
