"""The operations ledger: outside calls recorded before they are made, settled with evidence.

::

    ledger = Ledger(policy=ReconcilePolicy(max_checks=4))     # settings bound once
    op = ledger.perform(engine, system=supplier, operation="place-order",
                        request={"item": "widget"}, message_id=message_id)

:class:`Ledger` holds every operation (perform, begin / record_outcome / mark_unknown, the
reconcile passes, a person's resolutions, retention); the rest are the types they take and
return. docs/operations.md tells the whole story.
"""

from dedup.ledger.errors import (
    OperationError,
    OperationNotFound,
    RequestMismatch,
    ResolutionRefused,
)
from dedup.ledger.ledger import Ledger
from dedup.ledger.operations import Intent, OnSettle, Operation, OperationEvent, OperationStatus
from dedup.ledger.outcomes import (
    Applied,
    CallOutcome,
    Evidence,
    Found,
    NotFound,
    Refused,
    StatusOutcome,
    Unclear,
)
from dedup.ledger.policy import ReconcilePolicy
from dedup.ledger.reconcile import ReconcileReport
from dedup.ledger.retention import OperationsPurge
from dedup.ledger.systems import System

__all__ = [
    "Applied",
    "CallOutcome",
    "Evidence",
    "Found",
    "Intent",
    "Ledger",
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
]
