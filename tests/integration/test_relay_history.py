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
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, create_engine, text

from outbox.db.dsn import sqlalchemy_url
from outbox.db.migrate import migrate, migrations
from outbox.errors import ConfigurationError
from outbox.testing import postgres
from outbox.testing.postgres import PostgresCluster
from outbox.testing.processes import free_port, pid_alive
from outbox.testing.tools import postgres_bin_dir
from relay.claims import Published, claim_messages, record
from relay.commands import rebase_command, status_command
from relay.daemon import refused_privilege
from relay.history import HistoryMoved
from relay.roles import relay_grants
from tests.integration.databases import fresh_database
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


@contextmanager
def crashable() -> Iterator[tuple[PostgresCluster, Engine]]:
    """A cluster of the test's own with the outbox migrated, and an engine on it."""
    with cluster() as node:
        engine = migrated(node)
        try:
            yield node, engine
        finally:
            engine.dispose()


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
    with crashable() as (node, engine):
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


def test_a_batch_read_before_a_crash_restart_moves_no_cursor_after_it() -> None:
    with crashable() as (node, engine):
        reader = Reader(engine)
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL synchronous_commit = on"))  # survives the crash
            put(conn, "k", 0)
        owned = reader.lanes.owned()
        with reader.pool.connection() as conn:
            batch = claim_messages(conn, "outboxkit", relay_id="reader", cursors=owned,
                                   limit=100)
        [(lane, read)] = batch.reads.items()
        engine.dispose()
        crash(node)
        with reader.pool.begin() as conn:
            moved = record(conn, "outboxkit", relay_id="reader",
                           published=[Published(r, 0, r.id) for r in batch.rows],
                           failed=[], set_aside=[],
                           cursors={lane: (read.advanced(read.ids[-1]), 1)},
                           blocking=False, incarnation=batch.incarnation,
                           tokens=batch.tokens)
        assert moved == []  # its cursor may count re-issued ids as seen: not stored
        assert status(engine, batch.rows[0].id) == "pending"
        assert [r.id for r in reader.drain()] == [batch.rows[0].id]  # sent again


def dump_and_restore(source: PostgresCluster, target: PostgresCluster) -> None:
    bin_dir = postgres_bin_dir()
    dump = subprocess.run([str(bin_dir / "pg_dump"), "-Fc", "-d", source.dsn],
                          capture_output=True, check=True, timeout=120)
    subprocess.run([str(bin_dir / "pg_restore"), "-d", target.dsn, "--no-owner"],
                   input=dump.stdout, capture_output=True, check=True, timeout=120)


@pytest.mark.parametrize("new_counter", ["behind", "ahead"])
def test_a_restore_into_another_cluster_is_refused_until_rebased(
    kafka_bootstrap: str, new_counter: str
) -> None:
    with cluster() as old, cluster() as new:
        source = migrated(old)
        target = create_engine(sqlalchemy_url(new.dsn))
        try:
            # Behind: rows emitted on the new cluster get ids the old cursors count as seen.
            # Ahead: nothing in the ids tells; the cluster's identifier does.
            burn_unflushed_xids(old if new_counter == "behind" else new, 300)
            reader = Reader(source)
            with source.begin() as conn:
                sent = [put(conn, f"k{i}", i) for i in range(3)]
            assert len(reader.drain()) == 3
            with source.begin() as conn:
                put(conn, "k0", 3)  # pending when the database moves
            dump_and_restore(old, new)
            with target.begin() as conn, conn.begin_nested():
                # Emitted on the new cluster before the relays run, in a savepoint (its
                # tuple's xmin is the subtransaction's, not the row's xid).
                put(conn, "k1", 4)
            with target.begin() as conn:
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


def test_a_relay_role_of_an_earlier_version_keeps_working_after_the_upgrade(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migration 0010 grants the relay's role the two new tables: a role set up before it
    can still claim; a privilege missing stops the relay with a line naming it."""
    role = f"relay_{uuid.uuid4().hex[:8]}"
    everything = migrations()
    with fresh_database(postgres_dsn) as url:
        owner = create_engine(sqlalchemy_url(url))
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")  # type: ignore[arg-type]
        try:
            # outboxkit before 0010
            monkeypatch.setattr(sys.modules["outbox.db.migrate"], "migrations",
                                lambda: everything[:9])
            migrate(owner)
            earlier = "\n".join(line for line in relay_grants("outboxkit", role).splitlines()
                                if "relay_server" not in line and "relay_history" not in line)
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute(earlier)  # type: ignore[arg-type]
            monkeypatch.undo()
            assert migrate(owner) == [m.version for m in everything[9:]]  # 0010 on
            as_relay = create_engine(sqlalchemy_url(url.replace("postgres@", f"{role}:pw@")))
            reader = Reader(as_relay, relay_id="relay-role")
            with owner.begin() as conn:
                put(conn, "k", 0)
            assert len(reader.drain()) == 1  # it made the incarnation and read it
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute(f"REVOKE SELECT ON outboxkit.relay_history FROM {role}")  # type: ignore[arg-type]
            with pytest.raises(psycopg.ProgrammingError) as refused, \
                    reader.pool.connection() as conn:
                claim_messages(conn, "outboxkit", relay_id="relay-role",
                               cursors=reader.lanes.owned(), limit=10)
            with pytest.raises(ConfigurationError, match="relay_grants"):
                refused_privilege(refused.value)
            as_relay.dispose()
        finally:
            owner.dispose()
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
                admin.execute(f"DROP ROLE {role}")  # type: ignore[arg-type]
