"""outboxkit's `dedup` package: the consumers' dedup marks and the ledger of outside operations."""

from dedup.errors import OperationError, OperationNotFound, RequestMismatch, ResolutionRefused
from dedup.failures import FailedMessage, get_failure, list_failures
from dedup.inbox import Mark, is_marked, mark_many, purge_marks
from dedup.operations import (
    Intent,
    OnSettle,
    Operation,
    OperationEvent,
    OperationStatus,
    begin,
    get_operation,
    idempotency_key,
    mark_unknown,
    operation_history,
    record_outcome,
)
from dedup.outcomes import (
    Applied,
    CallOutcome,
    Evidence,
    Found,
    NotFound,
    Refused,
    StatusOutcome,
    Unclear,
)
from dedup.perform import perform
from dedup.policy import ReconcilePolicy
from dedup.reconcile import ReconcileReport, reconcile_due, reconcile_operation
from dedup.resolution import (
    count_operations,
    list_operations,
    resolve_confirmed,
    resolve_not_applied,
)
from dedup.retention import OperationsPurge, count_purgeable_operations, purge_operations
from dedup.scheduler import add_operations_retention_job, add_reconcile_job
from dedup.systems import System
from dedup.window import check_window

__all__ = [
    "Applied",
    "CallOutcome",
    "Evidence",
    "FailedMessage",
    "Found",
    "Intent",
    "Mark",
    "NotFound",
    "OnSettle",
    "Operation",
    "OperationError",
    "OperationEvent",
    "OperationNotFound",
    "OperationStatus",
    "OperationsPurge",
    "ReconcilePolicy",
    "ReconcileReport",
    "Refused",
    "RequestMismatch",
    "ResolutionRefused",
    "StatusOutcome",
    "System",
    "Unclear",
    "add_operations_retention_job",
    "add_reconcile_job",
    "begin",
    "check_window",
    "count_operations",
    "count_purgeable_operations",
    "get_failure",
    "get_operation",
    "idempotency_key",
    "is_marked",
    "list_failures",
    "list_operations",
    "mark_many",
    "mark_unknown",
    "operation_history",
    "perform",
    "purge_marks",
    "purge_operations",
    "reconcile_due",
    "reconcile_operation",
    "record_outcome",
    "resolve_confirmed",
    "resolve_not_applied",
]
