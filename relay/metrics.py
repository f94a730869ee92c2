"""The relay's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from typing import Any, NamedTuple

from psycopg.rows import namedtuple_row

from outbox.db.pool import Connection
from outbox.db.queries import driver_sql
from outbox.runtime import MetricFamilies

# Where a transient error came from: the label values of outboxkit_relay_transient_errors_total.
TRANSIENT_SOURCES = ("kafka", "postgres")

# The backlog gauge reads at most this many rows a lane; past it, it estimates the rest
# (relay/queries.sql: backlog).
BACKLOG_CAP = 256

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RelayMetrics:
    def __init__(self) -> None:
        families = MetricFamilies("relay")
        self.registry = families.registry
        self.backlog = families.gauge(
            "backlog_messages", "Outbox rows waiting to be published (all lanes)."
        )
        self.oldest_pending_age = families.gauge(
            "oldest_pending_age_seconds", "Age of the oldest pending outbox row (0 when none)."
        )
        self.failed_rows = families.gauge(
            "failed_messages", "Outbox rows marked failed, waiting for an operator."
        )
        self.published = families.counter(
            "published_total", "Messages acknowledged by Kafka and marked published."
        )
        self.failed = families.counter(
            "failed_total", "Messages Kafka refused for good (dead-lettered or blocking)."
        )
        self.dead_lettered = families.counter(
            "dead_lettered_total", "Messages copied to a dead-letter topic."
        )
        self.transient_errors = families.counter(
            "transient_errors_total",
            "Transient errors the relay retries after, by source: kafka (a batch refused "
            "or not acknowledged for 5 s, once per batch; the producer unable to start) or "
            "postgres (a claim, mark, idle flag or lane heartbeat that failed).",
            ["source"],
        )
        for source in TRANSIENT_SOURCES:
            self.transient_errors.labels(source)  # exported as 0 before the first error
        self.latency = families.histogram(
            "publish_latency_seconds",
            "From the row's creation to Kafka's acknowledgement.",
            LATENCY_BUCKETS,
        )
        self.unsettled_operations = families.gauge(
            "unsettled_operations",
            "Operations in the ledger whose outcome is not established: unknown (a reconciler "
            "asks the outside system) or needs-human (a person must resolve them).",
            ["status"],
        )
        self.lanes_owned = families.gauge("lanes_owned", "Lanes this relay publishes.")
        self.ready = families.gauge(
            "ready", "1 while the relay can reach PostgreSQL and Kafka."
        )


class Backlog(NamedTuple):
    """What :func:`read_backlog` found: the gauges' figures and the rows they come from."""

    backlog: int  # an estimate when ``estimated``
    oldest_age: float  # seconds; 0 when nothing waits
    failed: int  # refused rows (outbox_failures, 'failed')
    estimated: bool  # a lane's backlog was past the capped read
    by_topic: list[Any]  # (lane, topic, oldest, age, estimated, n): relay/queries.sql, backlog


def read_backlog(conn: Connection, schema: str, *, lanes: int, cap: int = BACKLOG_CAP) -> Backlog:
    """The backlog by lane and topic, at most *cap* rows read a lane (past it, estimated), and
    the refused rows' count, in *conn*'s transaction, whose planner settings are left as they
    were found. The relay's gauges and the console's overview both read it."""
    with conn.cursor(row_factory=namedtuple_row) as cursor:
        was: Any = cursor.execute(driver_sql("relay", "backlog_planner", schema)).fetchone()
        rows: list[Any] = cursor.execute(driver_sql("relay", "backlog", schema),
                                         {"cap": cap, "lanes": lanes}).fetchall()
        cursor.execute(driver_sql("relay", "planner_back", schema),
                       {"jit": was.jit, "bitmapscan": was.bitmapscan})
    return Backlog(
        sum(r.n for r in rows),
        max((float(r.age) for r in rows if r.age is not None), default=0.0),
        was.failed,
        any(r.estimated for r in rows),
        rows,
    )
