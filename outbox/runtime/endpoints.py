"""What a daemon needs before it can start: where PostgreSQL and Kafka are."""

from __future__ import annotations

from outbox.errors import ConfigurationError
from outbox.settings import ConnectionSettings


def required_database_url(settings: ConnectionSettings) -> str:
    """The database URL *settings* resolve to; a daemon without one or without Kafka bootstrap
    servers cannot start, and the error names the variables and flags that set them."""
    prefix = settings.model_config.get("env_prefix", "OUTBOXKIT_")
    url = settings.resolved_database_url()
    if not url:
        raise ConfigurationError(
            f"no database URL: set {prefix}DATABASE_URL (or OUTBOXKIT_DATABASE_URL) "
            "or pass --database-url"
        )
    if not settings.resolved_bootstrap():
        raise ConfigurationError(
            f"no Kafka bootstrap servers: set {prefix}KAFKA_BOOTSTRAP (or "
            "OUTBOXKIT_KAFKA_BOOTSTRAP) or pass --kafka-bootstrap"
        )
    return url
