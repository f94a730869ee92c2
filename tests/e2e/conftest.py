"""Helpers for end-to-end tests: relays as real OS processes, emits, and reading Kafka back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import Engine, text

from outbox.db.dsn import sqlalchemy_url
from outbox.messages.emit import emit_many
from outbox.messages.envelope import Envelope

# A broker's "record too large", as each Kafka client words it (kafka-python's exception,
# librdkafka's error name).
TOO_LARGE = re.compile("MessageSizeTooLarge|MSG_SIZE_TOO_LARGE")


@dataclass
class RelayProcesses:
    """Starts ``python -m relay`` processes and stops exactly those, by pid."""

    database_url: str
    kafka_bootstrap: str
    log_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, relay_id: str | None = None, **settings: Any) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "OUTBOXKIT_RELAY_DATABASE_URL": sqlalchemy_url(self.database_url),
            "OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "OUTBOXKIT_RELAY_RELAY_ID": relay_id or f"relay-{uuid.uuid4().hex[:6]}",
            "OUTBOXKIT_RELAY_LANE_LEASE_SECONDS": "3",
            "OUTBOXKIT_RELAY_POLL_INTERVAL_SECONDS": "0.5",
        }
        env.update({k if k.startswith("OUTBOXKIT_") else f"OUTBOXKIT_RELAY_{k.upper()}": str(v)
                    for k, v in settings.items()})
        log = (self.log_dir / f"{env['OUTBOXKIT_RELAY_RELAY_ID']}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def relays(database_url: str, kafka_bootstrap: str, tmp_path: Path) -> Iterator[RelayProcesses]:
    procs = RelayProcesses(database_url, kafka_bootstrap, tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def emit_batch(engine: Engine, envelopes: list[Envelope]) -> None:
    """Commit *envelopes* in one transaction, with one statement (emit_many: the order of
    each key is kept). These tests are about what happens to committed rows; a statement
    per row made the 50,000-row test spend most of its time writing them."""
    with engine.begin() as conn:
        emit_many(conn, envelopes)


def count_status(engine: Engine, status: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM outboxkit.message_status WHERE status = :s"),
                {"s": status},
            ).scalar_one()
        )


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def read_topic(bootstrap: str, topic: str, *, timeout_s: float = 60) -> list[Any]:
    """Every record in *topic* from the beginning up to its current end offsets.

    Checked: without transactions a partition's offsets have no gaps, so every offset from
    its beginning to its end must have been read. A reader that skipped a record would make
    a test report a loss that is not one (kafka-python 3.0's fetcher has lost records
    before: outbox/kafka/kafka_python_fixes.py); such a read is done again, and said so.
    """
    gaps: dict[int, list[int]] = {}
    for _ in range(3):
        records, gaps = _read_topic_once(bootstrap, topic, timeout_s)
        if not gaps:
            return records
        print(f"read_topic: the reader skipped offsets of {topic} (partition: offsets) "
              f"{gaps}; reading again", file=sys.stderr)
    raise AssertionError(f"the reader skipped offsets of {topic} three times: {gaps}")


def _read_topic_once(bootstrap: str, topic: str,
                     timeout_s: float) -> tuple[list[Any], dict[int, list[int]]]:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        group_id=None,
    )
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        if not partitions:  # not created yet (e.g. a dead-letter topic before its first record)
            return [], {}
        consumer.assign(partitions)
        end = consumer.end_offsets(partitions)
        start = consumer.beginning_offsets(partitions)
        consumer.seek_to_beginning(*partitions)
        records: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in partitions):
            if time.monotonic() > deadline:
                raise AssertionError(f"could not read {topic} to its end in {timeout_s} s")
            for batch in consumer.poll(timeout_ms=500, max_records=5000).values():
                records.extend(batch)
        read: dict[int, set[int]] = {tp.partition: set() for tp in partitions}
        for record in records:
            read[record.partition].add(record.offset)
        gaps = {tp.partition: missing for tp in partitions
                if (missing := sorted(set(range(start[tp], end[tp])) - read[tp.partition]))}
        return records, gaps
    finally:
        consumer.close()


def explain_missing(engine: Engine, bootstrap: str, topic: str, missing: set[str],
                    log_dir: Path | None = None) -> str:
    """Why committed messages were not found in *topic*: for each, its row, its lane's
    cursor and the proof recorded for it, and whether reading the topic again finds it.
    So that a failure seen once (under load, in CI) says whether the relay passed a row
    it never sent or the test's reader missed a record."""
    time.sleep(2)
    again = {dict(r.headers)["message-id"].decode() for r in read_topic(bootstrap, topic)}
    lines = [f"{len(missing)} committed messages not read from {topic}; read again: "
             f"{len(missing - again)} still missing"]
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT s.message_id::text, s.id, s.lane, m.xid::text, s.status, "
            "s.kafka_partition, s.kafka_offset, l.owner, l.token, l.cursor_snapshot, "
            "l.batch_snapshot, l.batch_pos FROM outboxkit.message_status AS s "
            "JOIN outboxkit.outbox_messages AS m ON m.id = s.id "
            "JOIN outboxkit.relay_lanes AS l ON l.lane = s.lane "
            "WHERE s.message_id::text = ANY(:ids) ORDER BY s.id"), {"ids": sorted(missing)})
        lines += [f"  {tuple(r)}" for r in rows]
    for log in sorted(log_dir.glob("*.log")) if log_dir else []:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        lines += [f"--- {log.name}", *tail]
    return "\n".join(lines)
