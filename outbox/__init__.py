"""outboxkit's write side: durable agent runs and the transactional outbox.

Start here: an :class:`App` registers workflows as step functions (``@app.workflow``), which
``outbox worker module:app`` runs (:mod:`outbox.worker`); ``app.start_run`` queues a run.
A step gets the claimed run's handle (:class:`ClaimedRun`, :class:`AsyncClaimedRun` for an
``async def``): every write under the run's lease goes through it. The app's other
operations (``app.emit``, ``app.get_run``, ``app.confirm``...) take your connection with
the settings bound once; ``X_async`` is the asyncio twin. Nothing here commits.
"""

from typing import TYPE_CHECKING

from outbox.errors import (
    ApprovalInvalid,
    ArtifactNotFound,
    CheckpointInvalid,
    CheckpointTooLarge,
    ConfigurationError,
    EvidenceRequired,
    IllegalTransition,
    InvalidMessage,
    LeaseLost,
    LeaseSpent,
    OutboxError,
    RunError,
    RunNotFound,
    SchemaError,
    StepAlreadyRecorded,
    WorkflowRetired,
)

if TYPE_CHECKING:
    from outbox.aio import AsyncClaimedRun
    from outbox.app import App
    from outbox.handle import ClaimedRun
    from outbox.messages.envelope import Envelope
    from outbox.runs.approvals import call_digest
    from outbox.runs.events import RunEvent
    from outbox.runs.lifecycle import Run, Transition
    from outbox.runs.retry import RetryPolicy
    from outbox.runs.signals import Signal
    from outbox.runs.states import RunState
    from outbox.runs.workflows import VersionPolicy, Workflow

# Imported when first used: a daemon that needs none of them (the relay imports
# outbox.backoff, outbox.settings...) does not pay for the write side's modules and
# SQLAlchemy's ORM and asyncio layers at start-up (a quarter of a second).
_LAZY = {
    "AsyncClaimedRun": "outbox.aio",
    "App": "outbox.app",
    "ClaimedRun": "outbox.handle",
    "Envelope": "outbox.messages.envelope",
    "call_digest": "outbox.runs.approvals",
    "RunEvent": "outbox.runs.events",
    "Run": "outbox.runs.lifecycle",
    "Transition": "outbox.runs.lifecycle",
    "RetryPolicy": "outbox.runs.retry",
    "Signal": "outbox.runs.signals",
    "RunState": "outbox.runs.states",
    "VersionPolicy": "outbox.runs.workflows",
    "Workflow": "outbox.runs.workflows",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'outbox' has no attribute {name!r}")
    import importlib  # noqa: PLC0415 - the point: only when a name is asked for

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "App",
    "ApprovalInvalid",
    "ArtifactNotFound",
    "AsyncClaimedRun",
    "CheckpointInvalid",
    "CheckpointTooLarge",
    "ClaimedRun",
    "ConfigurationError",
    "Envelope",
    "EvidenceRequired",
    "IllegalTransition",
    "InvalidMessage",
    "LeaseLost",
    "LeaseSpent",
    "OutboxError",
    "RetryPolicy",
    "Run",
    "RunError",
    "RunEvent",
    "RunNotFound",
    "RunState",
    "SchemaError",
    "Signal",
    "StepAlreadyRecorded",
    "Transition",
    "VersionPolicy",
    "Workflow",
    "WorkflowRetired",
    "call_digest",
]
