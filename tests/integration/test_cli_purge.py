"""`outbox purge`: retention of finished runs from the command line, with a dry run."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Engine, text

from outbox.handle import claim
from outbox.runs.lifecycle import start_run, transition
from tests.integration.cli_support import outbox


def finished(engine: Engine, key: str, days_ago: int) -> uuid.UUID:
    with engine.begin() as conn:
        start_run(conn, workflow="w", workflow_version="1", idempotency_key=key,
                  checkpoint={"big": "x" * 100})
        job = claim(conn, worker="w1", lease_seconds=30)
        assert job is not None
        transition(conn, job.lease, "done", evidence={"ok": True})
        conn.execute(text("UPDATE outboxkit.agent_runs SET finished_at = now() - "
                          "make_interval(days => :d) WHERE id = :i"),
                     {"d": days_ago, "i": job.run.id})
    return job.run.id


@pytest.fixture
def old_and_new(engine: Engine) -> tuple[list[uuid.UUID], uuid.UUID]:
    old = [finished(engine, f"old-{i}", 40) for i in range(3)]
    return old, finished(engine, "new", 1)


def test_dry_run_counts_and_changes_nothing_then_purge_drops_only_old_checkpoints(
    old_and_new: tuple[list[uuid.UUID], uuid.UUID], database_url: str, engine: Engine
) -> None:
    old, new = old_and_new
    dry = outbox("purge", "--older-than", "30d", "--dry-run", "--database-url", database_url)
    assert dry.returncode == 0, dry.stderr
    assert "would purge 3 runs" in dry.stdout
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outboxkit.agent_runs "
                                 "WHERE purged_at IS NOT NULL")).scalar_one() == 0
    result = outbox("purge", "--older-than", "30d", "--archive", "--batch-size", "2",
                    OUTBOXKIT_DATABASE_URL=database_url)
    assert result.returncode == 0, result.stderr
    assert "purged 3 runs" in result.stdout
    with engine.connect() as conn:
        purged = set(conn.execute(text("SELECT id FROM outboxkit.agent_runs "
                                       "WHERE purged_at IS NOT NULL")).scalars())
        archived = conn.execute(text("SELECT count(*) FROM outboxkit.run_archive")).scalar_one()
    assert purged == set(old)
    assert new not in purged
    assert archived == 3


def test_a_malformed_duration_is_a_usage_error(database_url: str) -> None:
    result = outbox("purge", "--older-than", "30 parsecs", "--database-url", database_url)
    assert result.returncode == 2
    assert "not a duration like 30d" in result.stderr
