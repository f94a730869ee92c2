"""Pure pieces of the run API: checkpoint bounds, approval scopes, workflow versions."""

from __future__ import annotations

import pytest

from outbox.errors import CheckpointTooLarge, ConfigurationError
from outbox.runs.approvals import covers
from outbox.runs.artifacts import ArtifactRef, digest_of
from outbox.runs.checkpoints import bounded, encoded_size
from outbox.runs.retry import RetryPolicy
from outbox.runs.workflows import VersionPolicy, Workflow
from outbox.settings import OutboxSettings


def test_checkpoint_over_the_limit_names_size_limit_and_artifacts() -> None:
    settings = OutboxSettings(max_checkpoint_bytes=10)
    with pytest.raises(CheckpointTooLarge) as caught:
        bounded({"text": "x" * 20}, settings)
    assert caught.value.limit == 10
    assert caught.value.size == encoded_size({"text": "x" * 20}) == 31
    assert "artifact" in str(caught.value)


def test_checkpoint_at_the_limit_is_accepted() -> None:
    bounded("x" * 8, OutboxSettings(max_checkpoint_bytes=10))  # '"xxxxxxxx"' is 10 bytes


def test_non_json_checkpoint_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        bounded({"raw": b"bytes"}, None)


@pytest.mark.parametrize(("granted", "required", "ok"), [
    ({"tool": "pay", "amount": 100}, {"tool": "pay"}, True),
    ({"tool": "pay", "amount": 100}, {"amount": 500}, False),
    ({"tool": "pay"}, {"recipient": "bob"}, False),
    ({"recipients": ["a", "b"]}, {"recipients": "a"}, True),
    ({"recipients": ["a", "b"]}, {"recipients": ["a", "c"]}, False),
    ("not an object", {"x": 1}, False),
])
def test_scope_coverage(granted: object, required: dict[str, object], ok: bool) -> None:
    assert (covers(granted, required) is None) is ok


def test_workflow_reports_which_pinned_versions_differ() -> None:
    wf = Workflow(name="w", version="2", prompt_version="p2")
    assert wf.version_change({"workflow_version": "2", "prompt_version": "p2"}) is None
    change = wf.version_change({"workflow_version": "1", "prompt_version": "p2",
                                "tool_schema_version": "t9"})
    assert change == "workflow_version 1 -> 2"


def test_migrate_policy_needs_a_migration_function() -> None:
    with pytest.raises(ConfigurationError):
        Workflow(name="w", version="2", on_version_change=VersionPolicy.MIGRATE)


def test_step_retry_policy_falls_back_to_the_workflows() -> None:
    special = RetryPolicy(max_attempts=9)
    wf = Workflow(name="w", version="1", step_retry={"pay": special})
    assert wf.retry_for("pay") is special
    assert wf.retry_for("other") is wf.retry is wf.retry_for(None)


def test_artifact_reference_round_trips_through_checkpoint_json() -> None:
    ref = ArtifactRef(digest_of(b"abc"), 3, "text/plain")
    assert ArtifactRef.from_json(ref.to_json()) == ref
    assert ref.digest == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
