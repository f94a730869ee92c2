"""The run-side names outbox exports (other components add theirs; this pins ours)."""

from __future__ import annotations

import inspect

import outbox
from outbox import aio
from outbox.runs import lifecycle as runs

RUN_API = {
    "App", "Approval", "ApprovalCheck", "ApprovalInvalid", "ArtifactNotFound", "ArtifactRef",
    "CheckpointInvalid", "CheckpointTooLarge", "ClaimedRun", "EvidenceRequired",
    "IllegalTransition", "Lease",
    "LeaseLost", "LeaseSpent", "RetryOutcome", "RetryPolicy", "Run", "RunError", "RunNotFound",
    "RunState",
    "StepAlreadyRecorded", "StepRecord", "StepRun", "Transition", "VersionPolicy", "Workflow",
    "WorkflowRetired", "claim", "get_run", "grant", "handle_failure", "history",
    "load_artifact", "move", "purge", "purge_batch", "read_log", "record", "recorded",
    "register",
    "release", "renew", "request_approval", "retire", "revalidate", "revoke", "run_step",
    "save_checkpoint", "start_run", "store_artifact", "transition", "wake",
}


def test_outbox_exports_the_run_api_sorted_and_importable() -> None:
    assert set(outbox.__all__) >= RUN_API
    assert outbox.__all__ == sorted(outbox.__all__)
    assert all(hasattr(outbox, name) for name in outbox.__all__)


def test_every_sync_writer_has_an_async_twin() -> None:
    sync_writers = {"start_run", "claim", "transition", "save_checkpoint", "renew", "release",
                    "move", "wake", "get_run", "history", "record", "recorded", "run_step",
                    "handle_failure", "store_artifact", "load_artifact", "request_approval",
                    "grant", "revoke", "revalidate", "register", "retire", "purge_batch",
                    "purge", "purgeable", "emit", "emit_many", "apply_confirmation",
                    "confirmations", "read_log"}
    assert sync_writers <= set(aio.__all__)
    assert all(callable(getattr(aio, name)) for name in aio.__all__)
    for function in (runs.claim, outbox.claim, aio.claim):
        assert function.__doc__ is not None
        assert "never commits" in function.__doc__.lower(), function.__module__


def test_the_async_handle_has_every_method_of_the_sync_one() -> None:
    """One convention for the handle too: same method names, awaited."""
    def methods(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert methods(outbox.ClaimedRun) == methods(aio.AsyncClaimedRun)
    for name in methods(outbox.ClaimedRun) - {"lease", "spent", "on", "checkpoint"}:
        assert inspect.iscoroutinefunction(getattr(aio.AsyncClaimedRun, name)), name
