"""Settings of the relay daemon, read from ``OUTBOXKIT_RELAY_*`` (CLI flags override)."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from outbox.kafka.api import REQUEST_TIMEOUT_MS
from outbox.settings import ConnectionSettings


def _default_relay_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RelaySettings(ConnectionSettings):
    """Everything an operator tunes on a relay; every field has a safe default."""

    model_config = SettingsConfigDict(env_prefix="OUTBOXKIT_RELAY_", frozen=True, extra="ignore")

    relay_id: str = Field(
        default_factory=_default_relay_id,
        min_length=1,
        description="Name of this relay instance in the relays table (default host-pid).",
    )
    batch_size: int = Field(default=1000, gt=0, le=50_000, description="Rows claimed per batch.")
    lane_lease_seconds: float = Field(
        default=10.0,
        ge=1.0,
        description="How long a relay owns its lanes without renewing; a dead relay's lanes "
        "move to the others after this.",
    )
    poll_interval_seconds: float = Field(
        default=1.0,
        gt=0,
        description="Fallback poll: the longest a committed row can wait if a NOTIFY is missed.",
    )
    idle_linger_ms: int = Field(
        default=5,
        ge=0,
        le=1000,
        description="Woken by a commit while idle, wait this long before reading, so that the "
        "commits right behind it go in the same batch (fewer cycles at light traffic, at most "
        "this much more latency).",
    )
    record_group_ms: int = Field(
        default=50,
        ge=0,
        le=10_000,
        description="Idle (light traffic), the records of the clean batches acknowledged within "
        "this long of the first are written in one statement: fewer writes and less CPU; "
        "publishing waits for nothing. A relay that dies meanwhile sends those rows again "
        "(duplicates with the same message ids). 0 records each batch at once.",
    )
    linger_ms: int | None = Field(
        default=None,
        ge=0,
        description="The producer's linger.ms. Unset: 0 with confluent-kafka (librdkafka sends "
        "a batch's first records while the relay still produces the rest), 5 with "
        "kafka-python (its Python sender costs per request: fewer, larger ones).",
    )
    producer_batch_bytes: int = Field(default=262_144, gt=0, description="kafka-python batch_size.")
    compression: Literal["none", "gzip", "lz4", "zstd", "snappy"] = Field(
        default="lz4", description="Producer compression (lz4 needs the `lz4` package)."
    )
    max_request_bytes: int = Field(
        default=1_048_576, gt=0, description="Producer max.request.size; larger rows fail."
    )
    delivery_timeout_ms: int = Field(
        default=120_000,
        gt=0,
        description="How long the producer retries one batch before reporting it failed.",
    )
    request_timeout_ms: int = Field(
        default=REQUEST_TIMEOUT_MS,
        ge=1000,
        description="How long one produce request waits for a broker's answer before the "
        "producer retries it (with fresh metadata): a broker that hangs without closing its "
        "connections holds the batch this long.",
    )
    create_topics: bool = Field(
        default=True,
        description="Create a missing topic on first use; when off, rows for it fail with "
        "an error that names the topic.",
    )
    topic_partitions: int = Field(default=6, gt=0, description="Partitions of created topics.")
    topic_replication: int = Field(
        default=-1,
        ge=-1,
        description="Replication of created topics; -1: the broker's default.replication.factor "
        "(its min.insync.replicas applies as well).",
    )
    on_permanent_failure: Literal["dead-letter", "block"] = Field(
        default="dead-letter",
        description="A message Kafka refuses for good: route it to `<topic><dlq_suffix>` and "
        "go on, or mark it failed and hold back its key until an operator retries it.",
    )
    dlq_suffix: str = Field(default=".dlq", min_length=1, description="Dead-letter topic suffix.")
    published_retention_seconds: float = Field(
        default=86_400.0,
        ge=0,
        description="Published rows are deleted after this long (0 keeps them forever).",
    )
    retention_batch: int = Field(default=5000, gt=0, description="Rows deleted per statement.")
    retention_interval_seconds: float = Field(
        default=30.0, gt=0, description="How often the retention job runs."
    )
    http_host: str = Field(
        default="127.0.0.1", description="Address of /metrics, /healthz, /readyz."
    )
    http_port: int = Field(
        default=0, ge=0, le=65535, description="Port of the HTTP endpoints (0: none)."
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, gt=0, description="On SIGTERM, the longest to wait for in-flight acks."
    )
    backoff_initial_seconds: float = Field(default=0.2, gt=0, description="First retry delay.")
    backoff_max_seconds: float = Field(default=30.0, gt=0, description="Longest retry delay.")
    log_format: Literal["text", "json"] = Field(default="text", description="Log line format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO")

    @field_validator("topic_replication")
    @classmethod
    def _replication(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 replicas: use -1 (the broker's default) or 1 and more")
        return value

    def resolved_linger_ms(self) -> int:
        """``linger_ms``, or the chosen Kafka client's own best when unset. Measured on a
        drain of 100,000 rows in interleaved pairs (docs/relay.md, "Throughput and sizing"):
        confluent-kafka at 0 ms 27,255-38,815 msg/s against 26,877-31,181 at 5 ms;
        kafka-python at 0 ms 11,928-13,263 against 14,701-14,708 at 5 ms."""
        if self.linger_ms is not None:
            return self.linger_ms
        return 0 if self.resolved_kafka_client() == "confluent" else 5
