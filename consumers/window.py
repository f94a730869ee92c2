"""Reading the topics' retention from the broker, to check the dedup window before starting."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from consumers.settings import ConsumerSettings
from dedup.window import check_window
from outbox.errors import ConfigurationError


def topic_retention_seconds(admin: Any, topics: Iterable[str]) -> dict[str, float | None]:
    """Each topic's ``retention.ms`` in seconds (None: unlimited, -1)."""
    wanted = sorted(set(topics))
    found = admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, t, configs=["retention.ms"]) for t in wanted],
        config_filter="all",  # the default reports only values changed from the broker's
    )
    configs = found.get("topic", {}) if isinstance(found, dict) else {}
    result: dict[str, float | None] = {}
    for topic in wanted:
        entry = (configs.get(topic) or {}).get("retention.ms")
        if entry is None:
            raise ConfigurationError(
                f"cannot read retention.ms of topic {topic!r} (does it exist?): create the "
                "topic first or set OUTBOXKIT_CONSUMER_TOPIC_RETENTION_SECONDS"
            )
        ms = int(entry["value"])
        result[topic] = None if ms < 0 else ms / 1000
    return result


def verify_window(settings: ConsumerSettings, topics: Iterable[str]) -> None:
    """Refuse a dedup window shorter than any topic's retention plus the max lag."""
    topics = list(topics)
    if settings.dedup_retention_seconds == 0 or not topics:
        return
    if settings.topic_retention_seconds is not None:
        retention: dict[str, float | None] = dict.fromkeys(topics, settings.topic_retention_seconds)
    else:
        admin = KafkaAdminClient(
            **settings.kafka_client_config(),
            client_id="outboxkit-consumer-window",
            request_timeout_ms=15_000,
        )
        try:
            retention = topic_retention_seconds(admin, topics)
        finally:
            admin.close()
    check_window(settings.dedup_retention_seconds, retention, settings.max_lag_seconds)
