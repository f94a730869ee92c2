"""dedup's public surface: the consumers' dedup marks in ``dedup``, the operations ledger in
``dedup.ledger``, every ledger operation spelled once, as a method of :class:`Ledger`."""

from __future__ import annotations

import importlib
import inspect

import pytest

import dedup
import dedup.ledger
from dedup.ledger import Ledger, ReconcilePolicy
from outbox.settings import OutboxSettings

DEDUP = ["Mark", "check_window", "is_marked", "mark_many", "purge_marks"]
LEDGER = [
    "Applied", "CallOutcome", "Evidence", "Found", "Intent", "Ledger", "NotFound", "OnSettle",
    "Operation", "OperationError", "OperationEvent", "OperationNotFound", "OperationStatus",
    "OperationsPurge", "ReconcilePolicy", "ReconcileReport", "Refused", "RequestMismatch",
    "ResolutionRefused", "StatusOutcome", "System", "Unclear",
]
LEDGER_OPERATIONS = [
    "add_reconcile_job", "add_retention_job", "begin", "count_operations", "count_purgeable",
    "get_operation", "history", "idempotency_key", "list_operations", "mark_unknown", "perform",
    "purge", "reconcile_due", "reconcile_operation", "record_outcome", "resolve_confirmed",
    "resolve_not_applied",
]


def test_dedup_exports_only_the_dedup_marks() -> None:
    assert dedup.__all__ == sorted(DEDUP)
    assert len(dedup.__all__) <= 8


def test_the_ledger_exports_the_pinned_surface() -> None:
    assert dedup.ledger.__all__ == sorted(LEDGER)
    assert len(dedup.ledger.__all__) <= 24


@pytest.mark.parametrize("package", ["dedup", "dedup.ledger"])
def test_each_name_is_sorted_and_importable(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__ == sorted(module.__all__, key=lambda name: (not name.isupper(), name))
    assert all(hasattr(module, name) for name in module.__all__)


def test_each_ledger_operation_is_a_method_without_a_settings_parameter() -> None:
    public = sorted(name for name, _ in inspect.getmembers(Ledger, callable)
                    if not name.startswith("_"))
    assert public == LEDGER_OPERATIONS
    for name in LEDGER_OPERATIONS:
        assert "settings" not in inspect.signature(getattr(Ledger, name)).parameters, name
    assert set(LEDGER_OPERATIONS).isdisjoint(dedup.__all__ + dedup.ledger.__all__)


def test_the_ledger_binds_settings_and_policy_once() -> None:
    settings, policy = OutboxSettings(schema_name="elsewhere"), ReconcilePolicy(max_checks=2)
    ledger = Ledger(settings=settings, policy=policy)
    assert (ledger.settings, ledger.policy) == (settings, policy)
    assert Ledger().policy == ReconcilePolicy()


def test_the_failures_table_belongs_to_the_consumers() -> None:
    failures = importlib.import_module("consumers.failures")
    assert callable(failures.list_failures)
    with pytest.raises(ImportError):
        importlib.import_module("dedup.failures")
