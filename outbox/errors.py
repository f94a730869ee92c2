"""The one error tree of outboxkit.

Every exception outboxkit raises on purpose derives from :class:`OutboxError`, and its
message says what to do. Driver errors (psycopg, SQLAlchemy, kafka-python) are translated
once, at the boundary that called the driver, with ``raise ... from exc`` so the cause
stays attached::

    OutboxError
    ├── ConfigurationError        a setting or argument is invalid; nothing was started
    ├── ServiceError              a local PostgreSQL / Kafka service could not be run
    │   └── MissingToolError      a required program (java, mvn, initdb) is not installed
    ├── SchemaError               the database schema is missing or at another version
    ├── InvalidMessage            a field of an envelope is invalid; nothing was written
    ├── RetryRefused              an outbox message asked to retry is not failed (or unknown)
    ├── RunError                  agent-run state machine errors
    │   ├── RunNotFound
    │   ├── IllegalTransition     the move is not allowed from the run's current state
    │   ├── LeaseLost             another worker holds the run now; stop writing for it
    │   ├── LeaseSpent            this worker ended its own lease; claim the run again
    │   ├── EvidenceRequired      ``done`` needs evidence
    │   ├── CheckpointTooLarge    the checkpoint exceeds the configured bound
    │   ├── CheckpointInvalid     the stored checkpoint does not fit the step function's type
    │   ├── StepAlreadyRecorded   the step has a recorded result; read it, don't redo it
    │   ├── ApprovalInvalid       an approval expired, was revoked or is out of scope
    │   ├── WorkflowRetired       the run's workflow no longer accepts work
    │   └── ArtifactNotFound      no artifact has this digest
    └── (more branches are added by relay, consumers and dedup)

Handler control flow (retry later, dead-letter, skip) deliberately lives outside this
tree, so that ``except OutboxError`` never swallows it.
"""

from __future__ import annotations

from uuid import UUID


class OutboxError(Exception):
    """Base of every error outboxkit raises on purpose."""


class ConfigurationError(OutboxError):
    """A setting or argument is invalid; fix it and start again."""


class ServiceError(OutboxError):
    """A local PostgreSQL or Kafka service could not be started, reached or stopped."""


class MissingToolError(ServiceError):
    """A program the local services need is not installed; the message says how to get it."""

    def __init__(self, tool: str, how_to_install: str) -> None:
        super().__init__(f"{tool} was not found. {how_to_install}")
        self.tool = tool
        self.how_to_install = how_to_install


class SchemaError(OutboxError):
    """The outboxkit schema is missing or at another version: run `outbox migrate`."""


class InvalidMessage(OutboxError):
    """An envelope failed validation before anything was written; fix *field* and emit again.

    Raised both when an :class:`~outbox.messages.envelope.Envelope` is built with a value of
    the wrong type (pydantic's ``ValidationError`` is then its ``__cause__``) and when ``emit``
    checks its content. *index* is the envelope's position in an ``emit_many`` batch.
    """

    def __init__(self, field: str, reason: str, *, index: int | None = None) -> None:
        where = f"envelopes[{index}]: " if index is not None else ""
        super().__init__(f"invalid message: {where}{field}: {reason}")
        self.field = field
        self.reason = reason
        self.index = index


class RetryRefused(OutboxError):
    """Outbox messages asked to retry are unknown or not ``failed``; nothing was changed."""

    def __init__(self, problems: dict[int, str | None]) -> None:
        listed = ", ".join(f"{mid} ({status or 'no such message'})"
                           for mid, status in sorted(problems.items()))
        super().__init__(
            f"only failed messages can be retried; not failed: {listed}; nothing was changed"
        )
        self.problems = problems


class RunError(OutboxError):
    """Base of the agent-run state machine errors."""


class LeaseLost(RunError):
    """The run's lease was taken over; this worker must stop writing for it."""

    def __init__(self, run_id: UUID, held_token: int) -> None:
        super().__init__(
            f"lease on run {run_id} lost (held token {held_token}): another worker owns the run "
            "now; stop working on it and roll back this transaction"
        )
        self.run_id, self.held_token = run_id, held_token

    @property
    def expected_token(self) -> int:
        """The token this worker held (the name the style guide uses)."""
        return self.held_token


class LeaseSpent(RunError):
    """A run handle was asked to write after its own lease ended; nothing was sent.

    *ended_by* says what ended it (a transition out of ``running``, a release, a failure
    handled, an approval that did not hold).
    """

    def __init__(self, run_id: UUID, ended_by: str) -> None:
        super().__init__(
            f"the lease on run {run_id} was already ended by {ended_by}: this handle writes "
            "nothing more; commit, and claim the run again to go on working on it"
        )
        self.run_id, self.ended_by = run_id, ended_by


class RunNotFound(RunError):
    """No run has this id (or it was never committed); check the id you were given."""

    def __init__(self, run_id: UUID) -> None:
        super().__init__(f"run {run_id} does not exist; check the id (was its start committed?)")
        self.run_id = run_id


class IllegalTransition(RunError):
    """The move is not allowed from the run's current state; nothing was written."""

    def __init__(
        self, run_id: UUID | None, from_state: str, to_state: str, detail: str = ""
    ) -> None:
        where = f"run {run_id}" if run_id is not None else "a run"
        super().__init__(
            f"{where} cannot move from {from_state!r} to {to_state!r}"
            + (f": {detail}" if detail else "")
            + "; nothing was written (see outbox.runs.states.ALLOWED for the moves that are)"
        )
        self.run_id, self.from_state, self.to_state, self.detail = (
            run_id, from_state, to_state, detail)


class EvidenceRequired(RunError):
    """``done`` needs evidence of what was done; pass ``evidence=`` to the transition."""

    def __init__(self, run_id: UUID | None, to_state: str) -> None:
        super().__init__(
            f"moving run {run_id} to {to_state!r} needs evidence (what confirms the work was "
            "done, e.g. the tool's response id); pass evidence={...}; nothing was written"
        )
        self.run_id, self.to_state = run_id, to_state


class CheckpointTooLarge(RunError):
    """The serialised checkpoint exceeds ``max_checkpoint_bytes``; store big parts as artifacts."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"checkpoint is {size} bytes, over the {limit}-byte limit (max_checkpoint_bytes): "
            "store large content with outbox.store_artifact and keep only its reference in the "
            "checkpoint; nothing was written. Retrying will not help."
        )
        self.size, self.limit = size, limit


class CheckpointInvalid(RunError):
    """The run's stored checkpoint does not validate as the type its step function declares."""

    def __init__(self, run_id: UUID | None, workflow: str, expected: str, detail: str) -> None:
        if run_id is None:  # refused before it was stored: nothing to migrate
            message = (f"the checkpoint given for workflow {workflow!r} is not a valid "
                       f"{expected} ({detail}); pass one that is (or fix the step function's "
                       "annotation). Nothing was written.")
        else:
            message = (f"run {run_id} of workflow {workflow!r}: the checkpoint is not a valid "
                       f"{expected} ({detail}); fix the checkpoint (or the step function's "
                       "annotation, or migrate it with the workflow's migrate=). Retrying will "
                       "not help.")
        super().__init__(message)
        self.run_id, self.workflow, self.expected = run_id, workflow, expected


class StepAlreadyRecorded(RunError):
    """The step's result was recorded before; read it with ``recorded`` instead of redoing it."""

    def __init__(self, run_id: UUID, step_key: str) -> None:
        super().__init__(
            f"step {step_key!r} of run {run_id} already has a recorded result: read it with "
            "outbox.recorded() (or use run_step, which does); nothing was written"
        )
        self.run_id, self.step_key = run_id, step_key


class ApprovalInvalid(RunError):
    """An approval expired, was revoked, is out of scope, was spent already, does not bind
    the arguments asked for or does not exist. *hint*: what to do instead."""

    def __init__(self, approval_id: UUID, reason: str, *,
                 hint: str = "request a new approval") -> None:
        super().__init__(f"approval {approval_id} is not usable: {reason}; {hint}")
        self.approval_id, self.reason = approval_id, reason


class WorkflowRetired(RunError):
    """The run's workflow was retired: its runs cannot be started, claimed or requeued."""

    def __init__(self, workflow: str, reason: str | None) -> None:
        super().__init__(
            f"workflow {workflow!r} is retired ({reason or 'no reason recorded'}): its runs are "
            "not started, claimed or requeued; register a new version or move the run to failed"
        )
        self.workflow, self.reason = workflow, reason


class ArtifactNotFound(RunError):
    """No artifact has this digest (never stored, or stored in an uncommitted transaction)."""

    def __init__(self, digest: str) -> None:
        super().__init__(
            f"no artifact with digest {digest}: was the transaction that stored it committed?"
        )
        self.digest = digest


class KafkaClientIncompatible(ConfigurationError):
    """The installed kafka-python lacks an internal a fix of outboxkit relies on; nothing
    was patched. Install a supported kafka-python, or use the confluent-kafka client."""

    def __init__(self, version: str, problems: list[str], supported: str) -> None:
        super().__init__(
            f"kafka-python {version} is installed, and outboxkit cannot apply its fixes for "
            f"kafka-python bugs (outbox/kafka/kafka_python_fixes.py): {'; '.join(problems)}. "
            f"Nothing was patched. outboxkit supports {supported} (pyproject.toml); install that, "
            "or use OUTBOXKIT_KAFKA_CLIENT=confluent"
        )
        self.version, self.problems, self.supported = version, problems, supported
