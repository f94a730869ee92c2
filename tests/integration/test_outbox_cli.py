"""The `outbox` command line as a user runs it, against the real PostgreSQL: once as a process
of its own (the migrate test), the rest in this process (cli_support.outbox)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
from sqlalchemy import Engine, text

from outbox.db.migrate import latest_version
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from tests.integration.cli_support import outbox, refuse
from tests.integration.databases import fresh_database


def outbox_process(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return subprocess.run([sys.executable, "-m", "outbox.cli.main", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **env}, check=False)


def test_migrate_dry_run_prints_sql_then_migrate_applies_it_once(postgres_dsn: str) -> None:
    with fresh_database(postgres_dsn) as url:
        dry = outbox_process("migrate", "--dry-run", "--database-url", url)
        assert dry.returncode == 0, dry.stderr
        assert "CREATE TABLE outboxkit.agent_runs" in dry.stdout
        with psycopg.connect(url) as conn:  # the dry run changed nothing
            assert conn.execute("SELECT to_regclass('outboxkit.agent_runs')").fetchone() == (None,)
        first = outbox_process("migrate", OUTBOXKIT_DATABASE_URL=url)
        assert first.returncode == 0, first.stderr
        expected = list(range(1, latest_version() + 1))
        assert f"applied migrations {expected}" in first.stdout
        again = outbox_process("migrate", OUTBOXKIT_DATABASE_URL=url)
        assert again.stdout.strip() == "schema is up to date"


def test_status_on_an_unmigrated_database_says_to_run_migrate(postgres_dsn: str) -> None:
    with fresh_database(postgres_dsn) as url:
        result = outbox("status", "--database-url", url)
    assert result.returncode == 1
    assert "run `outbox migrate` first" in result.stderr


def test_cannot_connect_names_where_it_tried_and_hides_the_password() -> None:
    result = outbox("status", "--database-url", "postgresql://me:hunter2@127.0.0.1:9/db")
    assert result.returncode == 1
    assert "cannot connect to postgresql://me:***@127.0.0.1:9/db" in result.stderr
    assert "hunter2" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_no_database_is_a_usage_error() -> None:
    result = outbox("status")
    assert result.returncode == 2
    assert "--database-url" in result.stderr


def test_status_reports_backlog_and_failed_as_json(engine: Engine, database_url: str) -> None:
    with engine.begin() as conn:
        for i in range(3):
            emit(conn, Envelope(topic="t", type="t", key="k", payload={"i": i}))
        first = conn.execute(text("SELECT min(id) FROM outboxkit.outbox_messages")).scalar_one()
        refuse(conn, first, error="refused")
    result = outbox("status", "--json", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert (status["pending"], status["failed"], status["relays"]) == (2, 1, [])
    assert status["oldest_pending_age_s"] >= 0
