"""Helpers for the consumer end-to-end tests: producing records, running consumers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient
from sqlalchemy import Engine, text

from consumers import Consumer, ConsumerSettings, Runner
from consumers.metrics import ConsumerMetrics
from outbox.db.dsn import sqlalchemy_url
from outbox.testing.processes import free_port
from tests.e2e.conftest import wait_until
from tests.e2e.consumer_app import EFFECTS_DDL


def produce(
    bootstrap: str,
    topic: str,
    items: list[dict[str, Any] | bytes],
    *,
    message_ids: list[str | None] | None = None,
    partition: int | None = None,
) -> list[str | None]:
    """Send *items* (dicts as JSON) in order; return the message ids used."""
    ids = message_ids or [str(uuid.uuid4()) for _ in items]
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    try:
        for item, message_id in zip(items, ids, strict=True):
            value = item if isinstance(item, bytes) else json.dumps(item).encode()
            headers = [("message-type", b"item")]
            if message_id is not None:
                headers.append(("message-id", message_id.encode()))
            key = None if partition is not None else str(uuid.uuid4()).encode()
            producer.send(topic, value=value, key=key, headers=headers, partition=partition)
        producer.flush(timeout=30)
    finally:
        producer.close()
    return ids


def wait_for_group(bootstrap: str, group_id: str, members: int, timeout: float = 90) -> None:
    """Wait until *group_id* is stable with *members* members, each holding a partition."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)

    def settled() -> bool:
        group = admin.describe_groups([group_id]).get(group_id) or {}
        found = group.get("members") or []
        return (
            group.get("group_state") == "Stable"
            and len(found) == members
            and all((m.get("member_assignment") or {}).get("assigned_partitions") for m in found)
        )

    try:
        wait_until(settled, timeout, f"{members} members in group {group_id}, each assigned")
    finally:
        admin.close()


def create_effects(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))


def effects(engine: Engine) -> dict[str, int]:
    """Rows per message id in the effects table."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT message_id, count(*) FROM public.consumer_effects GROUP BY 1")
        ).all()
    return {r[0]: r[1] for r in rows}


def settings(database_url: str, bootstrap: str, **overrides: Any) -> ConsumerSettings:
    values: dict[str, Any] = {
        "database_url": sqlalchemy_url(database_url),
        "kafka_bootstrap": bootstrap,
        "session_timeout_ms": 6000,
        "poll_timeout_ms": 200,
        "backoff_initial_seconds": 0.05,
        "backoff_max_seconds": 0.2,
        "max_attempts": 3,
        **overrides,
    }
    return ConsumerSettings(**values)


def sample(metrics: ConsumerMetrics, name: str, **labels: str) -> float:
    """Sample ``outboxkit_consumer_<name>`` of an in-process consumer's own registry, through
    prometheus_client's public API (0 before the first one)."""
    return metrics.registry.get_sample_value(f"outboxkit_consumer_{name}", labels) or 0.0


class InProcess:
    """Runs a Consumer app's Runner in a thread; ``stop()`` joins it."""

    def __init__(self, app: Consumer) -> None:
        self.runner = Runner(app)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def __enter__(self) -> InProcess:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.runner.stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the consumer did not stop within 60 s"
        if self.error is not None:
            raise self.error


@dataclass
class ConsumerProcesses:
    """``python -m consumers tests.e2e.consumer_app:app`` processes, stopped by their pid."""

    database_url: str
    bootstrap: str
    topic: str
    log_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    group_id: str = field(default_factory=lambda: f"e2e-{uuid.uuid4().hex[:8]}")
    app: str = "tests.e2e.consumer_app:app"

    def start(self, *, http_port: int | None = None, **env: str) -> subprocess.Popen[bytes]:
        environ = {
            **os.environ,
            "OUTBOXKIT_CONSUMER_DATABASE_URL": sqlalchemy_url(self.database_url),
            "OUTBOXKIT_CONSUMER_KAFKA_BOOTSTRAP": self.bootstrap,
            "OUTBOXKIT_CONSUMER_SESSION_TIMEOUT_MS": "6000",
            "OUTBOXKIT_CONSUMER_POLL_TIMEOUT_MS": "200",
            "OUTBOXKIT_CONSUMER_HTTP_PORT": str(http_port or 0),
            "OUTBOXKIT_CONSUMER_GROUP_ID": self.group_id,
            "TEST_CONSUMER_TOPIC": self.topic,
            **env,
        }
        log = (self.log_dir / f"consumer-{len(self.procs)}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "consumers", self.app],
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )
        log.close()
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self, proc: subprocess.Popen[bytes]) -> int:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=60)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("*.log")))


def scrape(port: int, name: str) -> float:
    """Sum of a metric's samples on a consumer's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith(name) and not line.startswith("#") and (line[len(name)] in "{ ")
    )


def wait_for_metric(
    port: int, name: str, predicate: Callable[[float], bool], timeout: float
) -> float:
    seen: list[float] = []

    def check() -> bool:
        try:
            seen.append(scrape(port, name))
        except OSError:
            return False
        return predicate(seen[-1])

    wait_until(check, timeout, f"{name} to satisfy the condition (last {seen[-1:]})")
    return seen[-1]


def port() -> int:
    return free_port()


def iter_ids(n: int) -> Iterator[str]:
    for _ in range(n):
        yield str(uuid.uuid4())
