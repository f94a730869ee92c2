"""Production's topology for the fault harness: a PostgreSQL primary with a synchronous
standby, and a 3-node Kafka cluster (RF 3, min.insync.replicas 2, no unclean election).

The two PostgreSQL nodes keep their folders and ports for the whole session; which one is
the primary changes with each failover. The processes get one URL naming both ports with
``target_session_attrs=read-write``, in a fixed order, so it stays valid whatever node
leads: after a failover the old primary's folder is cloned again from the promoted node and
started as its synchronous standby on its old port, and the next round can fail over back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from outbox.errors import ServiceError
from outbox.testing import kafka_cluster, pg_standby, postgres
from outbox.testing.kafka_cluster import KafkaCluster
from outbox.testing.postgres import PostgresCluster
from outbox.testing.processes import pid_alive, port_open, service_port

NODES = ("pg-a", "pg-b")
PG_BASE_FILE = "pg-base.txt"


@dataclass(frozen=True)
class Failover:
    """When a PostgreSQL failover's steps happened (time.time())."""

    killed_at: float
    closed_at: float
    promoted_at: float
    old_primary: str
    new_primary: str
    old_pid: int


class ClusterServices:
    """PostgreSQL primary + synchronous standby and a 3-node Kafka cluster, all started in
    folders of their own and stopped by pid."""

    def __init__(self, workdir: Path) -> None:
        self.kafka_home = workdir / "kafka-cluster"
        # The unprivileged postgres owner must enter the folder (pytest's tmp_path is root's).
        self.pg_base = Path(tempfile.mkdtemp(prefix="outboxkit-faults-pg-"))
        self.pg_base.chmod(0o755)
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / PG_BASE_FILE).write_text(str(self.pg_base))  # for cleanup_after()
        self.ports = {name: service_port() for name in NODES}
        while self.ports[NODES[0]] == self.ports[NODES[1]]:
            self.ports[NODES[1]] = service_port()
        self.primary, self.standby = NODES
        self.kafka: KafkaCluster | None = None
        self._killed_pid: int | None = None  # the last primary fail_over() SIGKILLed

    # --- life cycle ----------------------------------------------------------------------
    def up(self, database: str) -> tuple[str, str]:
        """Start everything; create *database* (commits wait for the standby); return the
        failover URL of *database* and the Kafka bootstrap list."""
        primary = postgres.start(self.folder(self.primary), self.ports[self.primary])
        pg_standby.start_standby(
            self.folder(self.primary), self.folder(self.standby),
            port=self.ports[self.standby], primary_port=primary.port, synchronous=True,
        )
        with psycopg.connect(primary.dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {database}")
            # The throwaway clusters default to synchronous_commit = off (speed): a commit
            # that returned must be on the standby too for "acknowledged" to mean anything.
            # A database setting replicates, so a promoted node keeps it.
            conn.execute(f"ALTER DATABASE {database} SET synchronous_commit = on")
        self.kafka = kafka_cluster.start_cluster(self.kafka_home, heap_mb=256,
                                                 ready_timeout_s=120)
        return self.url(database), self.kafka.bootstrap

    def down(self) -> None:
        """Stop every node this object started, whatever state a failed scenario left."""
        with contextlib.suppress(Exception):
            kafka_cluster.stop_cluster(self.kafka_home, grace_s=10)
        for name in NODES:
            with contextlib.suppress(Exception):
                postgres.stop(self.folder(name), grace_s=10)
        shutil.rmtree(self.pg_base, ignore_errors=True)

    # --- what the harness uses -----------------------------------------------------------
    def folder(self, name: str) -> Path:
        return self.pg_base / name

    def url(self, database: str) -> str:
        hosts = ",".join(f"127.0.0.1:{self.ports[n]}" for n in NODES)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def node(self, name: str) -> PostgresCluster | None:
        return postgres.running_cluster(self.folder(name))

    @property
    def k(self) -> KafkaCluster:
        if self.kafka is None:
            raise ServiceError("the Kafka cluster is not started: call up() first")
        return self.kafka

    # --- PostgreSQL failover -------------------------------------------------------------
    def fail_over(self) -> Failover:
        """SIGKILL the primary, and promote the standby as soon as the primary's port is
        closed (what a failover manager does once it sees the primary dead)."""
        primary = self.node(self.primary)
        if primary is None:
            raise ServiceError(f"no PostgreSQL primary runs from {self.folder(self.primary)}")
        killed_at = time.time()
        os.kill(primary.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while port_open(primary.port) and time.monotonic() < deadline:  # fds close at exit
            time.sleep(0.01)
        closed_at = time.time()
        pg_standby.promote(self.folder(self.standby))
        promoted_at = time.time()
        old, new = self.primary, self.standby
        self.primary, self.standby = new, old
        self._killed_pid = primary.pid
        return Failover(killed_at, closed_at, promoted_at, old, new, primary.pid)

    def rebuild_standby(self) -> float:
        """The dead old primary's folder becomes a synchronous standby of the promoted node,
        on its old port (the processes' URL stays valid); returns the seconds it took."""
        started = time.monotonic()
        primary = self.node(self.primary)
        if primary is None:
            raise ServiceError("no promoted primary runs: nothing to rebuild a standby from")
        old = self.folder(self.standby)
        postgres.stop(old, grace_s=5)  # normally dead already (SIGKILLed)
        self._forget_killed(old)
        shutil.rmtree(old / "data", ignore_errors=True)
        pg_standby.start_standby(
            self.folder(self.primary), old, port=self.ports[self.standby],
            primary_port=primary.port, synchronous=True,
        )
        return time.monotonic() - started


    def _forget_killed(self, folder: Path) -> None:
        """A SIGKILLed postmaster leaves its socket's lock file, naming its pid; until its
        parent reaps it that pid still "exists" (a zombie), and a new postmaster on the same
        port then refuses to start. Wait a while for it to go, then drop the stale files
        (its port is closed: nothing listens there)."""
        pid, self._killed_pid = self._killed_pid, None
        deadline = time.monotonic() + 10
        while pid is not None and pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        for stale in folder.glob(".s.PGSQL.*"):
            stale.unlink(missing_ok=True)


def cleanup_after(workdir: Path) -> None:
    """Stop whatever ClusterServices(workdir) left running, from its folders alone (a test's
    safety net when the harness itself could not stop: pids are read from the files)."""
    with contextlib.suppress(Exception):
        kafka_cluster.stop_cluster(workdir / "kafka-cluster", grace_s=10)
    try:
        pg_base = Path((workdir / PG_BASE_FILE).read_text().strip())
    except OSError:
        return
    for name in NODES:
        with contextlib.suppress(Exception):
            postgres.stop(pg_base / name, grace_s=10)
    shutil.rmtree(pg_base, ignore_errors=True)
