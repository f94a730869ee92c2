"""The consumer's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from outbox.runtime import MetricFamilies

BATCH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ConsumerMetrics:
    def __init__(self) -> None:
        families = MetricFamilies("consumer")
        self.registry = families.registry
        self.processed = families.counter(
            "processed_total", "Messages handled and committed with their dedup mark.", ["topic"]
        )
        self.duplicates = families.counter(
            "duplicates_total",
            "Redelivered messages dropped because their dedup mark was there.",
            ["topic"],
        )
        self.skipped = families.counter(
            "skipped_total", "Messages a handler skipped (SkipMessage).", ["topic"]
        )
        self.failures = families.counter(
            "failures_total",
            "Failed attempts (handler raised, or the message is malformed).",
            ["topic"],
        )
        self.dead_lettered = families.counter(
            "dead_lettered_total", "Messages sent to the dead-letter topic.", ["topic"]
        )
        self.parked = families.gauge(
            "parked_partitions",
            "Partitions held back by a failed message (per-message mode: partitions with a "
            "parked key).",
        )
        self.in_flight = families.gauge(
            "in_flight", "Per-message mode: messages being handled now."
        )
        self.parked_keys = families.gauge(
            "parked_keys",
            "Per-message mode: keys waiting for a retry of their first message.",
            ["topic", "partition"],
        )
        self.watermark_lag = families.gauge(
            "watermark_lag_messages",
            "Per-message mode: records read above the offset that may be committed (what a "
            "crash would redeliver, the dedup marks dropping what was done).",
            ["topic", "partition"],
        )
        self.lag = families.gauge(
            "lag_messages",
            "Messages behind the partition's high watermark.",
            ["topic", "partition"],
        )
        self.rebuilds = families.counter(
            "client_rebuilds_total",
            "Kafka clients the watchdog replaced: alive, but not working although records "
            "waited (consumers.watchdog).",
        )
        self.lag_total = families.gauge(
            "lag_total_messages", "Sum of the lag over the assigned partitions."
        )
        self.batch_seconds = families.histogram(
            "batch_seconds",
            "Time to process one poll batch (database commits included).",
            BATCH_BUCKETS,
        )
        self.purged = families.counter("dedup_purged_total", "Dedup marks deleted by retention.")
        self.ready = families.gauge("ready", "1 while the consumer polls and commits.")
