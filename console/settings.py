"""Settings of the operator console, read from ``OUTBOXKIT_CONSOLE_*`` (CLI flags override)."""

from __future__ import annotations

import os
import secrets

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConsoleSettings(BaseSettings):
    """Where the console listens and who may act in it."""

    # hide_input_in_errors: a bad value's error must not quote a password or the users' hashes.
    model_config = SettingsConfigDict(env_prefix="OUTBOXKIT_CONSOLE_", frozen=True,
                                      extra="ignore", hide_input_in_errors=True)

    database_url: SecretStr = Field(
        default=SecretStr(""),
        description="PostgreSQL URL of the outboxkit database (falls back to "
        "OUTBOXKIT_DATABASE_URL). Kept secret: never shown in a page or a log.",
    )
    kafka_bootstrap: str = Field(
        default="",
        description="Kafka bootstrap servers, to replay dead letters to their topics (falls "
        "back to OUTBOXKIT_KAFKA_BOOTSTRAP; TLS/SASL as the consumers', "
        "OUTBOXKIT_CONSUMER_KAFKA_*). Unset: pages work, replays are refused.",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Address to listen on. The default serves this machine only; put it "
        "behind TLS before listening on another address (basic auth sends passwords).",
    )
    port: int = Field(default=8470, ge=0, le=65535, description="Port to listen on (0: any).")
    allowed_hosts: str = Field(
        default="127.0.0.1,localhost,[::1]",
        description="Host names the console answers to (the request's Host header), comma "
        "separated; '*' for any. Another site cannot then reach it through DNS rebinding. "
        "Add the name it is served under behind a proxy.",
    )
    users: SecretStr = Field(
        default=SecretStr(""),
        description="Who may sign in: 'name:role:hash' entries separated by commas, role "
        "'operator' (reads and acts) or 'viewer' (reads only), hash from `outbox console "
        "hash-password`. Empty: nobody signs in and the pages are read-only.",
    )
    secret_key: SecretStr = Field(
        default_factory=lambda: SecretStr(secrets.token_hex(32)),
        description="Key of the forms' CSRF tokens. Default: a new random one per process "
        "(forms opened before a restart must be reloaded); set it when several console "
        "processes serve one address.",
    )
    page_size: int = Field(default=50, gt=0, le=500, description="Rows per page of a list.")
    refresh_seconds: float = Field(
        default=2.0, ge=0.5,
        description="How often an open overview page gets fresh counts (server-sent events).",
    )

    def resolved_database_url(self) -> str:
        return self.database_url.get_secret_value() or os.environ.get("OUTBOXKIT_DATABASE_URL", "")

    def resolved_bootstrap(self) -> str:
        return self.kafka_bootstrap or os.environ.get("OUTBOXKIT_KAFKA_BOOTSTRAP", "")
