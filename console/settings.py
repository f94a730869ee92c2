"""Settings of the operator console, read from ``OUTBOXKIT_CONSOLE_*`` (CLI flags override)."""

from __future__ import annotations

import secrets

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from outbox.settings import ConnectionSettings


class ConsoleSettings(ConnectionSettings):
    """Where the console listens and who may act in it."""

    model_config = SettingsConfigDict(env_prefix="OUTBOXKIT_CONSOLE_", frozen=True, extra="ignore")

    host: str = Field(
        default="127.0.0.1",
        description="Address to listen on. The default serves this machine only; put it "
        "behind TLS before listening on another address (basic auth sends passwords).",
    )
    port: int = Field(default=8470, ge=0, le=65535, description="Port to listen on (0: any).")
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
