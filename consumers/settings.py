"""Settings of an idempotent consumer, read from ``OUTBOXKIT_CONSUMER_*`` (flags override)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from outbox.backoff import Backoff
from outbox.settings import ConnectionSettings

DAY = 86_400.0


class ConsumerSettings(ConnectionSettings):
    """Everything an operator tunes on a consumer; every field has a safe default."""

    model_config = SettingsConfigDict(env_prefix="OUTBOXKIT_CONSUMER_", frozen=True, extra="ignore")

    group_id: str = Field(
        default="", description="Kafka consumer group; overrides the app's group_id when set."
    )
    mode: Literal["batch", "per-message"] = Field(
        default="batch",
        description="batch: one transaction per poll batch, a partition in offset order; "
        "per-message: one transaction per message, keys of a partition at the same time, "
        "each key in offset order.",
    )
    concurrency: int = Field(
        default=16, gt=0, le=1024,
        description="Per-message mode: messages handled at the same time (handler threads, "
        "each with its own database connection).",
    )
    max_held_per_partition: int = Field(
        default=2000, gt=0,
        description="Per-message mode: records of one partition read and not yet done "
        "(queued behind their key, running or parked) before the partition is paused.",
    )
    max_parked_keys: int = Field(
        default=100, gt=0,
        description="Per-message mode: keys of one partition waiting for a retry before the "
        "partition is paused.",
    )
    revoke_wait_seconds: float = Field(
        default=5.0, ge=0,
        description="Per-message mode: on a rebalance, the longest to wait for a revoked "
        "partition's running messages before its offset is committed without them.",
    )
    max_poll_records: int = Field(default=500, gt=0, le=50_000, description="Batch size.")
    switch_interval_ms: float | None = Field(
        default=None, gt=0, le=100,
        description="Python's thread switch interval while the consumer runs "
        "(sys.setswitchinterval): how long a thread whose database or Kafka answer arrived "
        "may wait for the interpreter's lock. Default: 0.5 ms when run as its own process "
        "(outbox consume, python -m consumers) with kafka-python, whose parsing takes turns "
        "with the handlers on that lock; otherwise the interpreter's own (5 ms).",
    )
    poll_timeout_ms: int = Field(default=500, gt=0, description="How long one poll waits.")
    max_attempts: int = Field(
        default=5, gt=0, le=1000, description="Attempts before a failing message is dead-lettered."
    )
    backoff_initial_seconds: float = Field(
        default=0.5, ge=0, description="Delay before the second attempt (doubles after)."
    )
    backoff_max_seconds: float = Field(default=10.0, ge=0, description="Longest retry delay.")
    dlq_suffix: str = Field(default=".dlq", min_length=1, description="Dead-letter topic suffix.")
    dedup_retention_seconds: float = Field(
        default=8 * DAY,
        ge=0,
        description="Dedup marks older than this are purged (0: keep forever). Must be at "
        "least the topic's retention plus max_lag_seconds, or the consumer refuses to start.",
    )
    max_lag_seconds: float = Field(
        default=DAY,
        ge=0,
        description="The longest this group may fall behind; part of the dedup window.",
    )
    topic_retention_seconds: float | None = Field(
        default=None,
        description="The topics' retention, for a consumer the broker does not tell "
        "(no DescribeConfigs); default: read retention.ms from the broker. Refused when "
        "shorter than the retention.ms the broker gives.",
    )
    retention_interval_seconds: float = Field(
        default=60.0, gt=0, description="How often old dedup marks are purged."
    )
    retention_batch: int = Field(default=5000, gt=0, description="Marks deleted per statement.")
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        default="earliest", description="Where a new group starts reading."
    )
    session_timeout_ms: int = Field(default=10_000, gt=0, description="Kafka session timeout.")
    watchdog_session_timeouts: float = Field(
        default=2.0, ge=0,
        description="Rebuild the Kafka client after it has done no work for this many session "
        "timeouts although records wait (assigned and reading nothing, or out of its group), "
        "reporting not-ready meanwhile; 0: no watchdog.",
    )
    max_poll_interval_ms: int = Field(
        default=300_000, gt=0,
        description="Kafka max.poll.interval.ms: the longest one batch's handlers may take.",
    )
    http_host: str = Field(default="127.0.0.1", description="Address of /metrics, /healthz.")
    http_port: int = Field(
        default=0, ge=0, le=65535, description="Port of the HTTP endpoints (0: none)."
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, gt=0, description="On SIGTERM, the longest to wait for the batch."
    )
    log_format: Literal["text", "json"] = Field(default="text", description="Log line format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO")

    def backoff(self, attempt: int) -> float:
        """The delay after failed attempt number *attempt* (1-based), before the next one."""
        return self.retry_backoff.delay(attempt)

    @property
    def retry_backoff(self) -> Backoff:
        """A failed message's delays: doubling from ``backoff_initial_seconds``, at most
        ``backoff_max_seconds``, no jitter (its partition waits, not a crowd of clients)."""
        return Backoff(base=min(self.backoff_initial_seconds, self.backoff_max_seconds),
                       cap=self.backoff_max_seconds)

