"""The public surface: each package's ``__all__`` pinned, small, and one spelling per act.

A user learns the library from ``__all__``; what is not for them stays in private modules.
Writes under a lease are spelled once on the handle (:class:`outbox.ClaimedRun`) and once on
its asyncio twin; every other operation once on :class:`outbox.App`, with an ``_async``
twin, settings bound on the app.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import outbox
from outbox import App, AsyncClaimedRun, ClaimedRun

OUTBOX = [
    "App", "ApprovalInvalid", "ArtifactNotFound", "AsyncClaimedRun", "CheckpointInvalid",
    "CheckpointTooLarge", "ClaimedRun", "ConfigurationError", "Envelope", "EvidenceRequired",
    "IllegalTransition", "InvalidMessage", "LeaseLost", "LeaseSpent", "OutboxError",
    "RetryPolicy", "Run", "RunError", "RunEvent", "RunNotFound", "RunState", "SchemaError",
    "Signal", "StepAlreadyRecorded", "Transition", "VersionPolicy", "Workflow",
    "WorkflowRetired", "call_digest",
]
# Every package a user imports from, and the ceiling of the whole surface.
PACKAGES = ("outbox", "outbox.aio", "outbox.worker", "relay", "consumers", "dedup",
            "dedup.ledger", "outbox_agents")
LEASE_OPERATIONS = ("transition", "save_checkpoint", "renew", "release", "record", "run_step",
                    "handle_failure", "revalidate", "emit", "emit_many", "receive",
                    "wait_for_signal", "wait_for_children", "spend_approval")
APP_OPERATIONS = ("start_run", "claim", "get_run", "history", "move", "wake", "confirm",
                  "confirmations", "recorded", "read_log", "run_events", "retire",
                  "request_approval", "grant", "revoke", "approvals_audit", "store_artifact",
                  "load_artifact", "emit", "emit_many", "signal")


def test_outbox_exports_the_pinned_surface_sorted_and_importable() -> None:
    assert outbox.__all__ == sorted(OUTBOX)
    assert len(outbox.__all__) <= 30
    assert all(hasattr(outbox, name) for name in outbox.__all__)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_lists_its_names_sorted_and_importable(package: str) -> None:
    module = importlib.import_module(package)
    # ruff's order (RUF022): CONSTANTS, then Classes and functions, each alphabetically.
    assert module.__all__ == sorted(module.__all__, key=lambda name: (not name.isupper(), name))
    assert all(hasattr(module, name) for name in module.__all__)


def test_the_whole_surface_stays_under_ninety_names() -> None:
    counts = {p: len(importlib.import_module(p).__all__) for p in PACKAGES}
    assert sum(counts.values()) <= 90, counts


def test_each_lease_operation_is_spelled_once_sync_and_once_async() -> None:
    for name in LEASE_OPERATIONS:
        assert inspect.isfunction(getattr(ClaimedRun, name)), name
        assert inspect.iscoroutinefunction(getattr(AsyncClaimedRun, name)), name
    public = {name for package in PACKAGES
              for name in importlib.import_module(package).__all__}
    assert public.isdisjoint(LEASE_OPERATIONS), "a lease operation outside the handle"


def test_the_async_handle_has_every_method_of_the_sync_one() -> None:
    def methods(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert methods(ClaimedRun) == methods(AsyncClaimedRun)


def test_every_app_operation_has_an_async_twin_and_no_settings_parameter() -> None:
    for name in APP_OPERATIONS:
        sync, twin = getattr(App, name), getattr(App, f"{name}_async")
        assert inspect.isfunction(sync), name
        assert not inspect.iscoroutinefunction(sync), name
        assert inspect.iscoroutinefunction(twin), name
        assert "settings" not in inspect.signature(sync).parameters, name
        assert "settings" not in inspect.signature(twin).parameters, name
    for handle in (ClaimedRun, AsyncClaimedRun):  # the handle carries them too
        for name, method in inspect.getmembers(handle, inspect.isfunction):
            if name != "__init__":
                assert "settings" not in inspect.signature(method).parameters, name


def test_write_operations_say_they_never_commit() -> None:
    from outbox import operations  # noqa: PLC0415

    assert "never commits" in (operations.__doc__ or "").lower()
    for function in (outbox.aio.emit, outbox.aio.apply_confirmation):
        assert "never commits" in (function.__doc__ or "").lower(), function.__qualname__
