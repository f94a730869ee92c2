"""Helpers for the PostgreSQL failover scenario (tests/e2e/test_pg_failover.py).

A primary and its streaming standby in a folder of their own, an agent-like writer that
commits through the failover URL and remembers what it was told committed, and the checks
run on the promoted node afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.handle import claim
from outbox.messages.envelope import Envelope
from outbox.runs.lifecycle import start_run
from outbox.testing import postgres
from outbox.testing.pg_standby import failover_url, start_standby
from outbox.testing.postgres import PostgresCluster
from outbox.testing.processes import free_port
from tests.e2e.consumer_app import EFFECTS_DDL

WORKFLOW = "pg-failover"
DBNAME = "app"


@dataclass(frozen=True)
class Pair:
    """A primary, its standby and the URL that reaches whichever of them takes writes."""

    base: Path
    primary: PostgresCluster
    standby: PostgresCluster
    url: str


@contextmanager
def pg_pair(*, synchronous: bool) -> Iterator[Pair]:
    """A primary + standby on free ports, in a folder the unprivileged postgres owner can
    enter (pytest's tmp_path is not, when we are root); both stopped and removed after."""
    base = Path(tempfile.mkdtemp(prefix="outboxkit-pg-failover-"))
    base.chmod(0o755)
    try:
        primary = postgres.start(base / "primary", free_port())
        standby = start_standby(
            base / "primary", base / "standby",
            port=free_port(), primary_port=primary.port, synchronous=synchronous,
        )
        with psycopg.connect(primary.dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"CREATE DATABASE {DBNAME}")
            # The throwaway clusters default to synchronous_commit = off (speed); a commit that
            # returns must be flushed (and, with a synchronous standby, on the standby) for
            # "acknowledged" to mean anything. A database setting replicates, so the promoted
            # node keeps it for the relay's and the consumer's sessions too.
            conn.execute(f"ALTER DATABASE {DBNAME} SET synchronous_commit = on")
        yield Pair(base, primary, standby, failover_url(primary, standby, DBNAME))
    finally:
        for node in ("standby", "primary"):
            postgres.stop(base / node, grace_s=10)
        shutil.rmtree(base, ignore_errors=True)


def migrate(url: str) -> None:
    """outbox migrate through the failover URL (as a deploy would), then the effects table."""
    done = subprocess.run(
        [sys.executable, "-m", "outbox.cli.main", "migrate", "--database-url", url],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "OUTBOXKIT_DATABASE_URL": url},
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(EFFECTS_DDL)


@dataclass(frozen=True)
class Ack:
    """A commit the writer was told succeeded."""

    n: int
    run_id: uuid.UUID
    message_id: uuid.UUID
    at: float  # time.time() when the commit returned


@dataclass
class Writer:
    """Commits agent-like transactions in a loop through the failover URL: start a run, claim
    it, emit its message and move it to done, all in one transaction. Remembers each commit
    that returned (acked) and counts those that raised (the connection died, no node took
    writes): their outcome is unknown, so they are never counted as acknowledged."""

    url: str
    topic: str
    pause_s: float = 0.02
    acked: list[Ack] = field(default_factory=list)
    failed: int = 0
    last_error: str = ""
    attempts: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    paused: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            assert not self._thread.is_alive(), "the writer did not stop within 30 s"
        if self.error is not None:
            raise self.error

    def acked_since(self, since: float) -> int:
        return sum(1 for a in self.acked if a.at >= since)

    def _run(self) -> None:
        # An engine as outboxkit's processes build one (pre-ping: a connection to the dead
        # primary is dropped and replaced, libpq then tries the hosts in order); the libpq
        # connect_timeout bounds an attempt on a port nobody answers.
        engine = create_engine(
            sqlalchemy_url(self.url), pool_size=1, max_overflow=0, pool_pre_ping=True,
            connect_args={"connect_timeout": 3},
        )
        try:
            while not self._stop.is_set():
                if not self.paused.is_set():
                    self._one(engine)
                time.sleep(self.pause_s)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
        finally:
            engine.dispose()

    def _one(self, engine: Engine) -> None:
        n = self.attempts
        self.attempts += 1
        try:
            with engine.begin() as conn:
                start_run(conn, workflow=WORKFLOW, workflow_version="1",
                                 idempotency_key=f"{WORKFLOW}-{n}")
                job = claim(conn, worker="pg-failover-writer", lease_seconds=60,
                                   workflows=[WORKFLOW])
                assert job is not None, "the run just started was not claimable"
                message_id = job.emit(Envelope(
                    topic=self.topic, type="item", key=f"k{n % 8}",
                    payload={"n": n, "run": str(job.run.id)},
                ))
                job.transition("done", evidence={"message_id": str(message_id)})
                run_id = job.run.id
        except SQLAlchemyError as exc:  # no node takes writes yet, or the connection died
            self.failed += 1
            orig = exc.orig if isinstance(exc, DBAPIError) else None
            self.last_error = (str(orig or exc).strip().splitlines() or [""])[0]
            time.sleep(0.05)
            return
        self.acked.append(Ack(n, run_id, message_id, time.time()))


@dataclass(frozen=True)
class NodeState:
    """What one node holds of the scenario: done runs, their messages, the effects."""

    runs: dict[uuid.UUID, str]  # done run -> the message id its evidence names
    unfinished_runs: int
    messages: dict[uuid.UUID, uuid.UUID]  # message id -> the run that emitted it
    effects: dict[str, int]  # message id -> effect rows


def node_state(cluster: PostgresCluster, topic: str) -> NodeState:
    """Read the scenario's rows from *cluster* itself (not through the failover URL)."""
    dsn = with_database(cluster.dsn, DBNAME)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        runs = {
            row[0]: str(row[1])
            for row in conn.execute(
                "SELECT id, last_evidence->>'message_id' FROM outboxkit.agent_runs"
                " WHERE workflow = %s AND state = 'done'", (WORKFLOW,))
        }
        unfinished = conn.execute(
            "SELECT count(*) FROM outboxkit.agent_runs WHERE workflow = %s AND state <> 'done'",
            (WORKFLOW,)).fetchone()
        messages = {
            row[0]: row[1]
            for row in conn.execute(
                "SELECT message_id, run_id FROM outboxkit.outbox_messages WHERE topic = %s",
                (topic,))
        }
        effects = {
            str(row[0]): int(row[1])
            for row in conn.execute(
                "SELECT message_id, count(*) FROM public.consumer_effects GROUP BY 1")
        }
    return NodeState(runs, int(str(unfinished[0])) if unfinished else 0, messages, effects)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll *predicate* (exceptions count as not yet); return the seconds it took."""
    started = time.monotonic()
    last: BaseException | None = None
    while time.monotonic() < started + timeout_s:
        try:
            if predicate():
                return time.monotonic() - started
        except Exception as exc:  # a node not answering yet: keep polling
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last error: {last})")
