"""outboxkit's write side: durable agent runs and the transactional outbox.

Start here: an :class:`App` registers workflows as step functions, which ``outbox worker
module:app`` (:mod:`outbox.worker`) runs. Underneath: :func:`start_run` queues a run;
:func:`claim` leases one and returns its handle (:class:`ClaimedRun`), whose writes carry the
lease for you; :func:`emit` adds a message in the caller's transaction. Nothing here commits.
The asyncio twin of ``outbox.X`` is ``outbox.aio.X``; ``settings=`` (keyword-only, default:
the environment) binds the rest.
"""

from outbox.app import App
from outbox.db.migrate import check_schema, migrate, pending_sql
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
    MissingToolError,
    OutboxError,
    RunError,
    RunNotFound,
    SchemaError,
    ServiceError,
    StepAlreadyRecorded,
    WorkflowRetired,
)
from outbox.handle import ClaimedRun, claim
from outbox.messages.emit import emit, emit_many
from outbox.messages.envelope import Envelope
from outbox.runs.approvals import (
    Approval,
    ApprovalCheck,
    grant,
    request_approval,
    revalidate,
    revoke,
)
from outbox.runs.artifacts import ArtifactRef, load_artifact, store_artifact
from outbox.runs.confirm import Confirmation, apply_confirmation, confirmations
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import (
    Run,
    Transition,
    get_run,
    history,
    move,
    release,
    renew,
    save_checkpoint,
    start_run,
    transition,
    wake,
)
from outbox.runs.retention import purge, purge_batch
from outbox.runs.retry import RetryOutcome, RetryPolicy, handle_failure
from outbox.runs.runlog import read_log
from outbox.runs.states import RunState
from outbox.runs.steps import StepRecord, StepRun, record, recorded, run_step
from outbox.runs.workflows import VersionPolicy, Workflow, register, retire

__all__ = [
    "App",
    "Approval",
    "ApprovalCheck",
    "ApprovalInvalid",
    "ArtifactNotFound",
    "ArtifactRef",
    "CheckpointInvalid",
    "CheckpointTooLarge",
    "ClaimedRun",
    "ConfigurationError",
    "Confirmation",
    "Envelope",
    "EvidenceRequired",
    "IllegalTransition",
    "InvalidMessage",
    "Lease",
    "LeaseLost",
    "LeaseSpent",
    "MissingToolError",
    "OutboxError",
    "RetryOutcome",
    "RetryPolicy",
    "Run",
    "RunError",
    "RunNotFound",
    "RunState",
    "SchemaError",
    "ServiceError",
    "StepAlreadyRecorded",
    "StepRecord",
    "StepRun",
    "Transition",
    "VersionPolicy",
    "Workflow",
    "WorkflowRetired",
    "apply_confirmation",
    "check_schema",
    "claim",
    "confirmations",
    "emit",
    "emit_many",
    "get_run",
    "grant",
    "handle_failure",
    "history",
    "load_artifact",
    "migrate",
    "move",
    "pending_sql",
    "purge",
    "purge_batch",
    "read_log",
    "record",
    "recorded",
    "register",
    "release",
    "renew",
    "request_approval",
    "retire",
    "revalidate",
    "revoke",
    "run_step",
    "save_checkpoint",
    "start_run",
    "store_artifact",
    "transition",
    "wake",
]
