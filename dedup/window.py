"""The dedup window rule: marks must outlive every redelivery Kafka can still make.

A message can be delivered again as long as it is in the topic (its retention) and a
consumer has not committed past it (its lag). Purging the mark before both have passed is
how duplicates come back (Wolverine #1725), so a shorter window is refused up front.
"""

from __future__ import annotations

from collections.abc import Mapping

from outbox.errors import ConfigurationError

KEEP_FOREVER = 0.0


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
        if needed is None:
            raise ConfigurationError(
                f"dedup retention of {dedup_retention_s:g} s is unsafe for topic {topic!r}, "
                "which keeps messages forever (retention.ms=-1): set the dedup retention to 0 "
                "(keep marks forever) or give the topic a retention"
            )
        if dedup_retention_s < needed:
            raise ConfigurationError(
                f"dedup retention of {dedup_retention_s:g} s is shorter than topic {topic!r}'s "
                f"retention ({retention:g} s) plus the max consumer lag ({max_lag_s:g} s): "
                f"marks would be purged while Kafka can still redeliver; set it to at least "
                f"{needed:g} s"
            )
