"""The relay's cursors and the server's history of transaction ids (relay/history.py,
relay/history.py, relay/rebase.py), on PostgreSQL clusters of the test's own.

A crash-restart hands out again the transaction ids whose WAL never reached disk; a restore
into another cluster hands out ids from another counter. A cursor (a snapshot of ids) read
before either could count a new transaction as seen: its rows would never be sent, and
``message_status`` would say published. Each test here lost a message before the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, create_engine, text

from outbox.dsn import sqlalchemy_url
from outbox.migrate import migrate
from outbox.testing import postgres
from outbox.testing.postgres import PostgresCluster
from outbox.testing.processes import free_port, pid_alive
from outbox.testing.tools import postgres_bin_dir
from relay.claims import Published, claim_messages, record
from relay.commands import rebase_command, status_command
from relay.history import HistoryMoved
from tests.integration.relay_support import Reader, put


@contextmanager
def cluster() -> Iterator[PostgresCluster]:
    """A cluster of this test's own (it gets crashed), in a folder its owner can enter. The WAL
    writer flushes every 10 s: what an asynchronous commit or an abort wrote stays in memory
    until then, so an immediate stop loses it, as a crash does."""
    base = Path(tempfile.mkdtemp(prefix="outboxkit-history-"))
    base.chmod(0o755)
    try:
        node = postgres.start(base / "pg", free_port())
        with psycopg.connect(node.dsn, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
            admin.execute("SELECT pg_reload_conf()")
        yield node
    finally:
        postgres.stop(base / "pg", grace_s=10)
        shutil.rmtree(base, ignore_errors=True)


def crash(node: PostgresCluster) -> PostgresCluster:
    """`pg_ctl stop -m immediate` (SIGQUIT to the postmaster), then start it again: crash
    recovery, on the same port."""
    os.kill(node.pid, signal.SIGQUIT)
    deadline = time.monotonic() + 30
    while pid_alive(node.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(node.pid)
    return postgres.start(node.data_dir, node.port)


def migrated(node: PostgresCluster) -> Engine:
    engine = create_engine(sqlalchemy_url(node.dsn), pool_pre_ping=True)
    migrate(engine)
    with engine.connect() as conn:  # the schema on disk: the crashes are to lose ids, not it
        conn.execute(text("CHECKPOINT"))
    return engine


def burn_unflushed_xids(node: PostgresCluster, n: int = 5) -> None:
    """Transactions that take an id and roll back: their abort records are not flushed."""
    with psycopg.connect(node.dsn) as conn:
        for _ in range(n):
            conn.execute("SELECT pg_current_xact_id()")
            conn.rollback()


def status(engine: Engine, row_id: int) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT status FROM outboxkit.message_status WHERE id = :i"),
                                {"i": row_id}).scalar_one())


def test_a_message_committed_after_a_crash_restart_is_published() -> None:
    with cluster() as node:
        engine = migrated(node)
        try:
            reader = Reader(engine)
            with engine.begin() as conn:
                put(conn, "k", 0)
            assert len(reader.drain()) == 1
            burn_unflushed_xids(node)
            # An empty claim moves the relay's cursor in memory only, past those ids.
            assert reader.step() == []
            engine.dispose()
            crash(node)
            with engine.begin() as conn:
                put(conn, "k", 1)  # its transaction re-uses an id the cursor counts as seen
            rows = reader.drain()
            assert [json.loads(r.payload)["i"] for r in rows] == [1]  # found, once
            assert status(engine, rows[0].id) == "published"
        finally:
            engine.dispose()


def test_a_batch_read_before_a_crash_restart_moves_no_cursor_after_it() -> None:
    with cluster() as node:
        engine = migrated(node)
        try:
            reader = Reader(engine)
            with engine.begin() as conn:
                conn.execute(text("SET LOCAL synchronous_commit = on"))  # survives the crash
                put(conn, "k", 0)
            owned = reader.lanes.owned()
            with engine.begin() as conn:
                batch = claim_messages(conn, "outboxkit", relay_id="reader", cursors=owned,
                                       limit=100)
            [(lane, read)] = batch.reads.items()
            engine.dispose()
            crash(node)
            with engine.begin() as conn:
                moved = record(conn, "outboxkit", relay_id="reader",
                               published=[Published(r, 0, r.id) for r in batch.rows],
                               failed=[], set_aside=[],
                               cursors={lane: (read.advanced(read.ids[-1]), 1)},
                               blocking=False, incarnation=batch.incarnation,
                               tokens=batch.tokens)
            assert moved == []  # its cursor may count re-issued ids as seen: not stored
            assert status(engine, batch.rows[0].id) == "pending"
            assert [r.id for r in reader.drain()] == [batch.rows[0].id]  # sent again
        finally:
            engine.dispose()


def dump_and_restore(source: PostgresCluster, target: PostgresCluster) -> None:
    bin_dir = postgres_bin_dir()
    dump = subprocess.run([str(bin_dir / "pg_dump"), "-Fc", "-d", source.dsn],
                          capture_output=True, check=True, timeout=120)
    subprocess.run([str(bin_dir / "pg_restore"), "-d", target.dsn, "--no-owner"],
                   input=dump.stdout, capture_output=True, check=True, timeout=120)


def test_a_restore_into_another_cluster_is_refused_until_rebased(kafka_bootstrap: str) -> None:
    with cluster() as old, cluster() as new:
        source = migrated(old)
        target = create_engine(sqlalchemy_url(new.dsn))
        try:
            burn_unflushed_xids(old, 300)  # the old counter is well ahead of the new one
            reader = Reader(source)
            with source.begin() as conn:
                sent = [put(conn, f"k{i}", i) for i in range(3)]
            assert len(reader.drain()) == 3
            with source.begin() as conn:
                put(conn, "k0", 3)  # pending when the database moves
            dump_and_restore(old, new)
            with target.begin() as conn:
                put(conn, "k1", 4)  # emitted on the new cluster before the relays run
                conn.execute(text("UPDATE outboxkit.relay_lanes SET expires_at = now()"))
            moved = Reader(target, relay_id="reader-2")
            with pytest.raises(HistoryMoved, match="outbox relay rebase"):
                moved.step()
            url = new.dsn
            shown = CliRunner().invoke(status_command, ["--database-url", url])
            assert "history moved" in shown.output, shown.output
            refused = CliRunner().invoke(rebase_command, ["--database-url", url, "--yes"])
            assert refused.exit_code != 0  # reader-2 still holds its lane
            assert "stop every relay" in refused.output
            with target.begin() as conn:  # reader-2 stopped: its lease ends
                conn.execute(text("UPDATE outboxkit.relay_lanes SET expires_at = now()"))
            daemon = subprocess.run(  # the real relay refuses to run, says why, gives lanes back
                [sys.executable, "-m", "relay", "--database-url", url,
                 "--kafka-bootstrap", kafka_bootstrap, "--relay-id", "restored"],
                capture_output=True, text=True, timeout=90, check=False)
            assert daemon.returncode == 2, daemon.stderr
            assert "outbox relay rebase" in daemon.stderr
            done = CliRunner().invoke(rebase_command, ["--database-url", url, "--yes"])
            assert done.exit_code == 0, done.output
            assert "3 rows kept" in done.output
            assert "2 rows pending" in done.output
            after = Reader(target, relay_id="reader-3")
            rows = after.drain()
            assert [(r.key, r.id > 0) for r in rows] == [(b"k0", True), (b"k1", True)]
            assert not {r.message_id for r in rows} & set(sent)
            again = CliRunner().invoke(rebase_command, ["--database-url", url, "--yes"])
            assert again.exit_code != 0
            assert "nothing to rebase" in again.output
        finally:
            source.dispose()
            target.dispose()
