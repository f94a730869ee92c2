"""Settings of the write side, read from ``OUTBOXKIT_*`` environment variables."""

from __future__ import annotations

import functools
import os
import re

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class OutboxSettings(BaseSettings):
    """Where the tables live and the bounds every write is checked against."""

    model_config = SettingsConfigDict(env_prefix="OUTBOXKIT_", frozen=True, extra="ignore")

    schema_name: str = Field(
        default="outboxkit",
        description="PostgreSQL schema holding the outboxkit tables (a lower-case identifier).",
    )
    max_message_bytes: int = Field(
        default=1_048_576,
        gt=0,
        description="Largest serialised message (key + payload + headers) accepted by emit; "
        "Kafka's default max.message.bytes is 1 MiB.",
    )
    max_checkpoint_bytes: int = Field(
        default=65_536,
        gt=0,
        description="Largest serialised checkpoint; store bigger things as artifacts.",
    )
    lanes: int = Field(
        default=64,
        gt=0,
        le=4096,
        description="Number of relay lanes rows are hashed into by key. Changing it while rows "
        "are pending can reorder a key across the change: drain the outbox first.",
    )
    notify_channel: str = Field(
        default="outboxkit_outbox",
        description="LISTEN/NOTIFY channel an idle relay waits on.",
    )
    relay_idle_seconds: float = Field(
        default=30.0,
        gt=0,
        description="An idle relay whose heartbeat is older than this is presumed dead: emits "
        "stop paying for NOTIFY to wake it (a live relay heartbeats more often than this).",
    )
    ordered_topics: frozenset[str] = Field(
        default=frozenset(),
        description="Topics whose messages must carry a key (per-key order is the contract); "
        'emit refuses a keyless message to them. From the environment as a JSON list: \'["a"]\'.',
    )

    @field_validator("schema_name", "notify_channel")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(
                f"{value!r} is not a plain lower-case PostgreSQL identifier "
                "(letters, digits and _, not starting with a digit, at most 63 characters)"
            )
        return value


@functools.cache
def default_settings() -> OutboxSettings:
    """The settings from the environment, read once per process (functions default to these)."""
    return OutboxSettings()


class ConnectionSettings(BaseSettings):
    """Where a daemon (relay, consumer) finds PostgreSQL and Kafka; each daemon's settings
    class extends this with its own ``env_prefix``, falling back to the shared
    ``OUTBOXKIT_DATABASE_URL`` / ``OUTBOXKIT_KAFKA_BOOTSTRAP``."""

    database_url: SecretStr = Field(
        default=SecretStr(""),
        description="PostgreSQL URL of the outboxkit database (falls back to "
        "OUTBOXKIT_DATABASE_URL). Kept secret: never logged.",
    )
    kafka_bootstrap: str = Field(
        default="",
        description="Kafka bootstrap servers, comma separated (falls back to "
        "OUTBOXKIT_KAFKA_BOOTSTRAP).",
    )

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap(cls, value: str) -> str:
        for server in filter(None, (s.strip() for s in value.split(","))):
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{server!r} is not host:port")
        return value

    def resolved_database_url(self) -> str:
        return self.database_url.get_secret_value() or os.environ.get("OUTBOXKIT_DATABASE_URL", "")

    def resolved_bootstrap(self) -> str:
        return self.kafka_bootstrap or os.environ.get("OUTBOXKIT_KAFKA_BOOTSTRAP", "")
