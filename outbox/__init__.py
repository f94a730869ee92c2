"""outboxkit's write side: durable agent runs and the transactional outbox.

Start here: :func:`start_run` queues a run; :func:`claim` leases one and returns its handle
(:class:`ClaimedRun`), whose writes carry the lease for you; :func:`emit` adds a message in
the caller's transaction. Nothing here commits. The asyncio twin of ``outbox.X`` is
``outbox.aio.X``; ``settings=`` (keyword-only, default: the environment) binds the rest.
"""

from outbox.approvals import Approval, ApprovalCheck, grant, request_approval, revalidate, revoke
from outbox.artifacts import ArtifactRef, load_artifact, store_artifact
from outbox.confirm import Confirmation, apply_confirmation, confirmations
from outbox.emit import emit, emit_many
from outbox.envelope import Envelope
from outbox.errors import (
    ApprovalInvalid,
    ArtifactNotFound,
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
from outbox.leases import Lease
from outbox.migrate import check_schema, migrate, pending_sql
from outbox.retention import purge, purge_batch
from outbox.retry import RetryOutcome, RetryPolicy, handle_failure
from outbox.runlog import read_log
from outbox.runs import (
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
from outbox.states import RunState
from outbox.steps import StepRecord, StepRun, record, recorded, run_step
from outbox.workflows import VersionPolicy, Workflow, register, retire

__all__ = [
    "Approval",
    "ApprovalCheck",
    "ApprovalInvalid",
    "ArtifactNotFound",
    "ArtifactRef",
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
