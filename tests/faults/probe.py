"""A steady publish probe: how long publishing stops during a fault, measured by the broker.

A thread commits one small outbox message about every 50 ms through the failover URL, each
in its own transaction, to a probe topic nobody consumes; the relays publish it like any
other. The topic has ``message.timestamp.type=LogAppendTime``, so every record carries the
time the partition leader appended it: the longest gap between appends that overlaps a
fault is that fault's unavailability, end to end (database, relay, broker), seen by Kafka
itself and not by any process's memory.

A commit that raised is counted as unknown (the connection died: it may or may not have
committed), never as acknowledged; every acknowledged one must reach Kafka.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import create_engine
from sqlalchemy.exc import SQLAlchemyError

from outbox.db.dsn import sqlalchemy_url
from outbox.messages.emit import emit
from outbox.messages.envelope import HEADER_MESSAGE_ID, Envelope

PARTITIONS = 1  # one leader: killing it stops the whole probe, as the relay sees it
TOPIC_CONFIGS = {"message.timestamp.type": "LogAppendTime"}


@dataclass(frozen=True)
class Appended:
    message_id: str
    at: float  # the broker's append time, seconds since the epoch


@dataclass
class ProbeFigures:
    unavailability_s: float | None  # the longest gap between appends overlapping the window
    gap_from: float | None  # the gap's ends (time.time())
    gap_to: float | None
    acked: int
    unknown: int
    lost: list[str]
    resent: int  # acked probe messages in Kafka more than once


@dataclass
class Probe:
    url: str
    topic: str
    bootstrap: str
    interval_s: float = 0.05
    acked: list[tuple[str, float]] = field(default_factory=list)  # (message id, time.time())
    unknown: list[float] = field(default_factory=list)  # when a commit raised
    last_error: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="publish-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self) -> None:
        # As the processes build theirs: pre-ping drops a connection to a dead primary and
        # libpq tries the hosts in order; connect_timeout bounds an attempt nobody answers.
        engine = create_engine(sqlalchemy_url(self.url), pool_size=1, max_overflow=0,
                               pool_pre_ping=True, connect_args={"connect_timeout": 3})
        n = 0
        try:
            while not self._stop.wait(self.interval_s):
                n += 1
                envelope = Envelope(topic=self.topic, type="probe", key=f"p{n % PARTITIONS}",
                                    payload={"n": n})
                try:
                    with engine.begin() as conn:
                        emit(conn, envelope)
                except SQLAlchemyError as exc:  # no node takes writes, or the connection died
                    self.unknown.append(time.time())
                    self.last_error = (str(exc).strip().splitlines() or [""])[0][:200]
                    continue
                self.acked.append((str(envelope.message_id), time.time()))
        finally:
            engine.dispose()

    # --- after a scenario ----------------------------------------------------------------
    def appended(self) -> list[Appended]:
        """Every probe record in Kafka with its broker append time, oldest first."""
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                 client_id="publish-probe", request_timeout_ms=30_000)
        try:
            parts = [TopicPartition(self.topic, p) for p in range(PARTITIONS)]
            consumer.assign(parts)
            consumer.seek_to_beginning(*parts)
            end = consumer.end_offsets(parts)
            out: list[Appended] = []
            deadline = time.monotonic() + 60
            while any(consumer.position(tp) < end[tp] for tp in parts):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reading {self.topic} took more than 60 s")
                for records in consumer.poll(timeout_ms=1000).values():
                    for r in records:
                        mid = dict(r.headers).get(HEADER_MESSAGE_ID, b"").decode()
                        out.append(Appended(mid, r.timestamp / 1000))
            return sorted(out, key=lambda a: a.at)
        finally:
            consumer.close(autocommit=False)

    def figures(self, window: tuple[float, float], since: float, until: float,
                wait_s: float = 30.0) -> ProbeFigures:
        """The longest publishing gap overlapping *window* (time.time() start and end), and
        the probe messages acknowledged between *since* and *until* that Kafka lacks (after
        waiting up to *wait_s* for the relays to publish them) or holds twice."""
        mine = [mid for mid, at in list(self.acked) if since <= at <= until]
        deadline = time.monotonic() + wait_s
        while True:
            appended = self.appended()
            seen = Counter(a.message_id for a in appended)
            lost = [mid for mid in mine if seen[mid] == 0]
            if not lost or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        start, end = window
        gap: tuple[float, float] | None = None
        for before, after in itertools.pairwise(appended):
            overlaps = after.at >= start and before.at <= end
            if overlaps and (gap is None or after.at - before.at > gap[1] - gap[0]):
                gap = (before.at, after.at)
        return ProbeFigures(
            unavailability_s=round(gap[1] - gap[0], 2) if gap else None,
            gap_from=gap[0] if gap else None,
            gap_to=gap[1] if gap else None,
            acked=len(mine),
            unknown=sum(1 for at in list(self.unknown) if since <= at <= until),
            lost=lost,
            resent=sum(seen[mid] - 1 for mid in mine if seen[mid] > 1),
        )


def probe_topic() -> str:
    return f"publish-probe-{uuid.uuid4().hex[:6]}"
