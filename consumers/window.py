"""Checking the dedup window against the topics' real retention before consuming.

The retention comes from the broker (``retention.ms``), never from a figure that could
understate it: a window sized on 1 h for a topic that keeps 30 days purges marks while
Kafka can still redeliver. A topic that does not exist yet is waited for, since on a first
deployment the relay creates it when it first publishes.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from consumers.settings import ConsumerSettings
from dedup.window import check_window, human_duration
from outbox.errors import ConfigurationError
from outbox.kafka import KafkaClientError

log = logging.getLogger(__name__)

WAIT_INTERVAL_S = 5.0
"""How often a consumer waiting for its topics asks the broker again."""

UNREADABLE = "unreadable"
"""The topic exists but the broker did not give its ``retention.ms`` (e.g. no permission)."""

Retention = float | None | str
"""Seconds; None: kept forever (``retention.ms=-1``); or :data:`UNREADABLE`."""


def topic_retention(admin: Any, topics: Iterable[str]) -> tuple[dict[str, Retention], set[str]]:
    """Each existing topic's ``retention.ms`` in seconds, and the topics that do not exist."""
    wanted = sorted(set(topics))
    existing = admin.existing_topics(wanted)  # these alone, not the cluster's whole list
    present = [t for t in wanted if t in existing]
    result: dict[str, Retention] = {}
    for topic, values in admin.topic_configs(present, ["retention.ms"]).items():
        entry = None if values is None else values.get("retention.ms")
        if entry is None:
            result[topic] = UNREADABLE
            continue
        ms = int(entry)
        result[topic] = None if ms < 0 else ms / 1000
    return result, set(wanted) - existing


def await_retention(
    admin: Any, topics: Iterable[str], stop: threading.Event,
    interval_s: float = WAIT_INTERVAL_S,
) -> dict[str, Retention] | None:
    """:func:`topic_retention` once every topic exists; None if *stop* is set first."""
    waited_for: set[str] = set()
    while True:
        try:
            retention, missing = topic_retention(admin, topics)
        except KafkaClientError as exc:
            if not waited_for:
                raise  # not waiting yet: a broker that cannot answer at all is reported
            log.warning("asking the broker about topic %s failed (%s: %s); still waiting",
                        ", ".join(sorted(waited_for)), type(exc).__name__, exc,
                        extra={"event": "consumer.topic_wait_failed"})
        else:
            if not missing:
                if waited_for:
                    log.info("topic %s exists now; checking the dedup window",
                             ", ".join(sorted(waited_for)),
                             extra={"event": "consumer.topic_appeared"})
                return retention
            if not waited_for:
                # One line: on a first deployment this is expected, not an error.
                log.info(
                    "waiting for topic %s to be created (the relay creates a topic when it "
                    "first publishes to it); checking every %s",
                    ", ".join(sorted(missing)), human_duration(interval_s),
                    extra={"event": "consumer.topic_missing"},
                )
                waited_for = set(missing)
        if stop.wait(interval_s):
            return None


def refuse_understatement(stated_s: float, actual: Mapping[str, float | None]) -> None:
    """Refuse a ``topic_retention_seconds`` shorter than a topic's real ``retention.ms``."""
    for topic, real in sorted(actual.items()):
        if real is not None and stated_s >= real:
            continue
        kept = "keeps messages forever (retention.ms=-1)" if real is None else (
            f"keeps messages {human_duration(real)} (retention.ms={real * 1000:.0f})")
        fix = "unset it" if real is None else f"set it to at least {math.ceil(real)} s or unset it"
        raise ConfigurationError(
            f"topic_retention_seconds says the topics keep messages {human_duration(stated_s)}, "
            f"but the broker says topic {topic!r} {kept}: the dedup window would be checked "
            f"against too short a figure; {fix} (OUTBOXKIT_CONSUMER_TOPIC_RETENTION_SECONDS, "
            "--topic-retention-seconds) to use the broker's"
        )


def verify_window(
    settings: ConsumerSettings,
    topics: Iterable[str],
    stop: threading.Event | None = None,
    *,
    interval_s: float = WAIT_INTERVAL_S,
) -> bool:
    """Refuse a dedup window shorter than any topic's retention plus the max lag.

    Waits for topics that do not exist yet; False when *stop* is set while waiting (the
    window was not checked), True when it was checked and is safe.
    """
    wanted = sorted(set(topics))
    dedup_s, lag_s = settings.dedup_retention_seconds, settings.max_lag_seconds
    if dedup_s == 0 or not wanted:
        return True
    stated = settings.topic_retention_seconds
    if stated is not None:
        # Too short already on the stated figure: no need to ask the broker.
        check_window(dedup_s, dict.fromkeys(wanted, stated), lag_s)
    admin = settings.kafka().admin("outboxkit-consumer-window")
    try:
        found = await_retention(admin, wanted, stop or threading.Event(), interval_s)
    finally:
        admin.close()
    if found is None:
        return False
    readable: dict[str, float | None] = {}
    unreadable: list[str] = []
    for topic, retention in sorted(found.items()):
        if isinstance(retention, str):
            unreadable.append(topic)
        else:
            readable[topic] = retention
    if unreadable:
        if stated is None:
            raise ConfigurationError(
                f"cannot read retention.ms of topic {', '.join(map(repr, unreadable))} (it "
                "exists: is this consumer allowed DescribeConfigs on it?): grant it, or set "
                "OUTBOXKIT_CONSUMER_TOPIC_RETENTION_SECONDS to the topic's retention"
            )
        log.warning(
            "cannot read retention.ms of topic %s; trusting topic_retention_seconds (%s)",
            ", ".join(unreadable), human_duration(stated),
            extra={"event": "consumer.retention_unreadable"},
        )
    if stated is not None:
        refuse_understatement(stated, readable)
        readable.update(dict.fromkeys(unreadable, stated))
    check_window(dedup_s, readable, lag_s)
    return True
