"""Settings of the agent worker, read from ``OUTBOXKIT_WORKER_*`` (CLI flags override)."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox.settings import answer_timeout_field


def _default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    """Everything an operator tunes on a worker; every field has a safe default."""

    # A ValidationError's text would otherwise quote the raw database URL.
    model_config = SettingsConfigDict(env_prefix="OUTBOXKIT_WORKER_", frozen=True,
                                      extra="ignore", hide_input_in_errors=True)

    database_url: SecretStr = Field(
        default=SecretStr(""),
        description="PostgreSQL URL of the outboxkit database (falls back to the app's "
        "database_url, then OUTBOXKIT_DATABASE_URL). Kept secret: never logged.",
    )
    database_answer_timeout_seconds: float = answer_timeout_field()
    name: str = Field(
        default_factory=_default_name,
        min_length=1,
        description="This worker's name: the lease owner and actor in the runs' history "
        "(default host-pid).",
    )
    concurrency: int = Field(
        default=4, gt=0, le=1000,
        description="Steps in flight at once (threads for sync step functions, tasks for async "
        "ones); the worker claims a run only while fewer are running.",
    )
    lease_seconds: float = Field(
        default=60.0, gt=0,
        description="Lease taken with each claim. A step must commit within it: after it, "
        "another worker may take the run over and this step's writes fail (LeaseLost).",
    )
    poll_seconds: float = Field(
        default=30.0, gt=0,
        description="Fallback poll while idle: NOTIFY wakes the worker for new, woken, "
        "confirmed and requeued runs and it sleeps until the next due time it knows of, so this "
        "only bounds how late a missed notification is noticed.",
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, gt=0,
        description="On SIGTERM, how long in-flight steps may take to finish; a step still "
        "running then is abandoned: nothing of it commits and its lease expires.",
    )
    http_host: str = Field(default="127.0.0.1", description="Address of /metrics, /healthz.")
    http_port: int = Field(
        default=0, ge=0, le=65535, description="Port of the HTTP endpoints (0: none)."
    )
    log_format: Literal["text", "json"] = Field(default="text", description="Log line format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO")

    def resolved_database_url(self, fallback: str | None = None) -> str:
        """This setting, else *fallback* (the app's), else ``OUTBOXKIT_DATABASE_URL``."""
        return (self.database_url.get_secret_value() or fallback
                or os.environ.get("OUTBOXKIT_DATABASE_URL", ""))
