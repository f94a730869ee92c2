"""A PostgreSQL primary with a streaming standby: replication, synchronous commits, failover.

Real processes on free loopback ports, in a folder of their own (the clusters run as an
unprivileged owner who cannot enter pytest's tmp_path when we are root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.testing import pg_standby, postgres
from outbox.testing.pg_standby import failover_url, promote, start_standby, stop_standby
from outbox.testing.postgres import PostgresCluster
from outbox.testing.processes import free_port, pid_alive, port_open

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def nodes_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="outboxkit-pg-standby-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        for node in ("standby", "primary"):
            postgres.stop(base / node, grace_s=10)
        shutil.rmtree(base, ignore_errors=True)


def start_pair(base: Path, *, synchronous: bool) -> tuple[PostgresCluster, PostgresCluster]:
    primary = postgres.start(base / "primary", free_port())
    standby = start_standby(
        base / "primary", base / "standby",
        port=free_port(), primary_port=primary.port, synchronous=synchronous,
    )
    return primary, standby


def connect(cluster: PostgresCluster, dbname: str = "postgres") -> psycopg.Connection[
        tuple[object, ...]]:
    return psycopg.connect(with_database(cluster.dsn, dbname), autocommit=True, connect_timeout=5)


def wait_rows(cluster: PostgresCluster, dbname: str, want: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    rows: list[int] = []
    while time.monotonic() < deadline:
        with connect(cluster, dbname) as conn:
            try:
                rows = [int(str(r[0])) for r in conn.execute("SELECT x FROM t ORDER BY x")]
            except psycopg.errors.UndefinedTable:  # not replayed yet
                rows = []
        if rows == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"port {cluster.port} has rows {rows}, not {want}")


def outbox_migrate(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli.main", "migrate", "--database-url", url],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "OUTBOXKIT_DATABASE_URL": url},
    )


def test_async_standby_replays_the_primary_and_is_read_only(nodes_dir: Path) -> None:
    primary, standby = start_pair(nodes_dir, synchronous=False)
    assert pg_standby.running_standby(nodes_dir / "standby") == standby
    assert pg_standby.is_standby(nodes_dir / "standby")
    with connect(primary) as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")
    wait_rows(standby, "postgres", [1], timeout_s=10)
    with connect(standby) as conn:
        assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("INSERT INTO t VALUES (2)")
    assert stop_standby(nodes_dir / "standby")
    assert not pid_alive(standby.pid)
    assert not stop_standby(nodes_dir / "standby")


def test_sync_standby_holds_commits_then_takes_over_after_the_primary_is_killed(
    nodes_dir: Path,
) -> None:
    primary, standby = start_pair(nodes_dir, synchronous=True)
    with connect(primary) as pg:
        pg.execute("CREATE DATABASE app")
    url = failover_url(primary, standby, "app")
    migrated = outbox_migrate(url)
    assert migrated.returncode == 0, migrated.stderr
    assert "applied migrations" in migrated.stdout

    # An engine as outboxkit's processes build one, connected before the failover.
    engine = create_engine(sqlalchemy_url(url), pool_size=2, pool_pre_ping=True)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x int)"))
            conn.execute(text("SET LOCAL synchronous_commit = on"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
            assert conn.execute(text("SELECT inet_server_port()")).scalar() == primary.port

        # Synchronous: with the standby down, a commit does not return...
        assert stop_standby(nodes_dir / "standby")
        returned = threading.Event()
        failure: list[BaseException] = []

        def commit_two() -> None:
            try:
                with connect(primary, "app") as pg:
                    pg.execute("SET synchronous_commit = on")
                    pg.execute("INSERT INTO t VALUES (2)")
            except BaseException as exc:  # reported by the test thread
                failure.append(exc)
            finally:
                returned.set()

        waiter = threading.Thread(target=commit_two, daemon=True)
        waiter.start()
        assert not returned.wait(2.0), f"the commit returned without its standby: {failure}"
        with connect(primary, "app") as pg:
            # ...nor is it visible to anyone else while it waits.
            assert pg.execute("SELECT count(*) FROM t WHERE x = 2").fetchone() == (0,)
        # ...until the standby is back and has flushed it.
        standby = start_standby(
            nodes_dir / "primary", nodes_dir / "standby",
            port=standby.port, primary_port=primary.port, synchronous=True,
        )
        assert returned.wait(20.0), "the commit still waits with its standby back"
        assert not failure, failure
        wait_rows(standby, "app", [1, 2], timeout_s=10)

        # Failover: SIGKILL the primary, promote the standby.
        killed = time.monotonic()
        os.kill(primary.pid, signal.SIGKILL)
        # Its listening socket closes as it dies (the pid itself lingers as a zombie until
        # whoever adopted the daemon reaps it, which is no part of the failover).
        deadline = time.monotonic() + 10
        while port_open(primary.port) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not port_open(primary.port)
        # Before the promotion no node accepts writes: the engine must not find one.
        with pytest.raises(OperationalError), engine.begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (-1)"))
        refused = time.monotonic()
        promote(nodes_dir / "standby")
        promoted = time.monotonic()
        assert not pg_standby.is_standby(nodes_dir / "standby")

        attempts = 0
        written = None
        while written is None and time.monotonic() < promoted + 15:
            attempts += 1
            try:
                with engine.begin() as conn:
                    conn.execute(text("INSERT INTO t VALUES (3)"))
                    port = conn.execute(text("SELECT inet_server_port()")).scalar()
                written = time.monotonic()
            except OperationalError:
                time.sleep(0.05)
        assert written is not None, "no write through the failover URL after the promotion"
        assert port == standby.port
        with engine.connect() as conn:
            rows = [r[0] for r in conn.execute(text("SELECT x FROM t ORDER BY x"))]
        assert rows == [1, 2, 3], "a synchronous commit was lost in the failover"
    finally:
        engine.dispose()

    again = outbox_migrate(url)
    assert again.returncode == 0, again.stderr
    assert "schema is up to date" in again.stdout
    print(
        f"\nfailover: kill -> write refused (no primary) {refused - killed:.2f} s, "
        f"promote {promoted - refused:.2f} s, kill -> promoted {promoted - killed:.2f} s, "
        f"promoted -> first write {written - promoted:.2f} s ({attempts} attempt(s)), "
        f"kill -> first write {written - killed:.2f} s"
    )
