"""Artifacts are stored once by digest; oversized checkpoints are refused (real PostgreSQL)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, select

from outbox.db.tables import artifacts as artifacts_table
from outbox.errors import ArtifactNotFound, CheckpointTooLarge
from outbox.runs import artifacts
from outbox.runs import lifecycle as runs
from outbox.settings import OutboxSettings

SMALL = OutboxSettings(max_checkpoint_bytes=64)


def test_the_same_bytes_are_stored_once_and_load_back(runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        first = artifacts.store_artifact(conn, b"x" * 10_000, media_type="text/plain")
        second = artifacts.store_artifact(conn, b"x" * 10_000, media_type="text/plain")
    assert first == second
    with runs_engine.connect() as conn:
        rows = conn.execute(select(func.count()).select_from(artifacts_table)).scalar_one()
        loaded = artifacts.load_artifact(
            conn, artifacts.ArtifactRef.from_json(first.to_json()))
    assert rows == 1
    assert loaded == b"x" * 10_000


def test_loading_an_unknown_digest_raises_artifact_not_found(runs_engine: Engine) -> None:
    with runs_engine.connect() as conn, pytest.raises(ArtifactNotFound):
        artifacts.load_artifact(conn, "sha256:" + "0" * 64)


def test_an_oversized_checkpoint_is_refused_everywhere_and_nothing_is_written(
        runs_engine: Engine, snapshot) -> None:
    big = {"transcript": "y" * 100}
    with runs_engine.begin() as conn:
        runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k",
                       settings=SMALL)
        got = runs.claim(conn, worker="w", lease_seconds=60, settings=SMALL)
    assert got is not None
    before = snapshot()
    with runs_engine.begin() as conn:
        with pytest.raises(CheckpointTooLarge) as caught:
            runs.save_checkpoint(conn, got.lease, big, settings=SMALL)
        with pytest.raises(CheckpointTooLarge):
            runs.transition(conn, got.lease, "waiting", checkpoint=big, settings=SMALL)
        with pytest.raises(CheckpointTooLarge):
            runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k2",
                           checkpoint=big, settings=SMALL)
    assert (caught.value.size, caught.value.limit) == (117, 64)
    assert snapshot() == before


def test_a_checkpoint_can_hold_an_artifact_reference_instead(runs_engine: Engine) -> None:
    with runs_engine.begin() as conn:
        runs.start_run(conn, workflow="wf", workflow_version="1", idempotency_key="k")
        got = runs.claim(conn, worker="w", lease_seconds=60)
        assert got is not None
        ref = artifacts.store_artifact(conn, b"y" * 100_000)
        runs.save_checkpoint(conn, got.lease, {"transcript": ref.to_json()},
                             settings=OutboxSettings(max_checkpoint_bytes=200))
        stored = runs.get_run(conn, got.run.id)
        ref_back = artifacts.ArtifactRef.from_json(stored.checkpoint["transcript"])
        assert artifacts.load_artifact(conn, ref_back) == b"y" * 100_000
