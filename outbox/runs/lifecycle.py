"""Agent runs as explicit state machines in PostgreSQL: start, claim, move, checkpoint.

Every function takes the caller's ``Connection`` or ``Session`` and **never commits**: the
run's change becomes visible, together with whatever else the caller wrote (an outbox
message, a step result), only when the caller commits. Writes by a lease holder are fenced
(see :mod:`outbox.runs.fencing`): after another worker claimed the run they raise
:class:`~outbox.errors.LeaseLost` and write nothing. The async twins live in :mod:`outbox.aio`.

History rows whose ``from_state`` equals ``to_state`` are annotations (a lease taken over, a
release, a version policy applied), not moves: the moves are exactly
:data:`outbox.runs.states.ALLOWED`.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    RowMapping,
    Text,
    case,
    cast,
    exists,
    func,
    literal,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import Session

from outbox.db.execution import (
    DriverStatement,
    Plan,
    SyncConn,
    driver_row,
    missing_schema,
    run_plan,
)
from outbox.db.queries import driver_sql
from outbox.db.tables import agent_runs, run_transitions, workflows
from outbox.errors import (
    ConfigurationError,
    EvidenceRequired,
    IllegalTransition,
    RunNotFound,
    WorkflowRetired,
)
from outbox.runs import compensation, fencing, moves, runlog, wakeups
from outbox.runs.checkpoints import KEEP, checkpoint_value
from outbox.runs.leases import Lease
from outbox.runs.states import FINISHED, RunState, sources
from outbox.runs.workflows import VersionPolicy, Workflow
from outbox.runtime.failpoints import failpoint
from outbox.settings import OutboxSettings, default_settings

runs = agent_runs
MAX_POLICY_SKIPS = 16
"""A claim moves at most this many runs to needs-human (version review) before giving up."""


HELD_AT = datetime(9000, 1, 1, tzinfo=UTC)
"""A child held back by its parent's concurrency bound (:mod:`outbox.runs.children`) has
``not_before`` at or after this time: no claim takes it before then, and the microseconds
past it keep the items' order. A finite time, which every driver reads (psycopg refuses
'infinity'), far enough from 9999 for any session time zone. :attr:`Run.held` reads it."""


@dataclass(frozen=True)
class Run:
    """A run as stored. ``step`` / ``checkpoint`` are the last confirmed progress."""

    id: uuid.UUID
    workflow: str
    workflow_version: str
    prompt_version: str | None
    tool_schema_version: str | None
    state: RunState
    step: str | None
    checkpoint: Any
    last_evidence: Any
    idempotency_key: str
    attempts: int
    not_before: datetime | None
    reason: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    purged_at: datetime | None
    parent_id: uuid.UUID | None = None
    """The run whose step started this one (:mod:`outbox.runs.children`)."""
    compensating_since: datetime | None = None
    """Set while the run undoes its effects (:mod:`outbox.runs.compensation`)."""
    on_child_failure: str | None = None
    """What a failed child does to this run, as its join declared (``"fail"``,
    ``"compensate"``; :mod:`outbox.runs.children`)."""
    failed_child: uuid.UUID | None = None
    """The child whose failure woke this run (a fail-fast join's)."""

    @property
    def held(self) -> bool:
        """True for a child its parent's concurrency bound holds back (queued, not due)."""
        return self.not_before is not None and self.not_before >= HELD_AT

    @property
    def purged(self) -> bool:
        """True when retention removed the checkpoint: the run is a tombstone for its key."""
        return self.purged_at is not None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Run:
        return cls(
            id=row["id"], workflow=row["workflow"], workflow_version=row["workflow_version"],
            prompt_version=row["prompt_version"], tool_schema_version=row["tool_schema_version"],
            state=RunState(row["state"]), step=row["step"], checkpoint=row["checkpoint"],
            last_evidence=row["last_evidence"], idempotency_key=row["idempotency_key"],
            attempts=row["attempts"], not_before=row["not_before"], reason=row["reason"],
            created_at=row["created_at"], updated_at=row["updated_at"],
            finished_at=row["finished_at"], purged_at=row["purged_at"],
            parent_id=row.get("parent_id"), compensating_since=row.get("compensating_since"),
            on_child_failure=row.get("on_child_failure"), failed_child=row.get("failed_child"),
        )


@dataclass(frozen=True)
class Claim:
    """A claimed run and the lease to write with; resume from ``run.step`` / ``run.checkpoint``."""

    run: Run
    lease: Lease


@dataclass(frozen=True)
class ClaimAttempt:
    """What one claim did: the run it claimed (or ``None``) and how many runs its version
    policy moved to ``needs-human`` on the way (more may be waiting when that is not 0)."""

    claim: Claim | None
    skipped: int


@dataclass(frozen=True)
class Transition:
    """One ``run_transitions`` row."""

    id: int
    run_id: uuid.UUID
    from_state: str | None
    to_state: str
    step: str | None
    reason: str | None
    evidence: Any
    actor: str | None
    lease_token: int | None
    at: datetime


@dataclass(frozen=True)
class RunView:
    """A run with who holds its lease and its checkpoint's size (what operators look at)."""

    run: Run
    lease_owner: str | None
    lease_expires_at: datetime | None
    checkpoint_bytes: int | None


def _lease_from(row: RowMapping) -> Lease:
    return Lease(run_id=row["id"], owner=row["lease_owner"], token=row["lease_token"],
                 version=row["version"], expires_at=row["lease_expires_at"])


# --- plans (shared by the sync functions below and outbox.aio) -------------------------


def start_run_plan(
    *, workflow: str, workflow_version: str, idempotency_key: str, checkpoint: Any,
    prompt_version: str | None, tool_schema_version: str | None,
    settings: OutboxSettings | None, notify: bool = True, parent_id: uuid.UUID | None = None,
) -> Plan[Run]:
    """*parent_id*: a child run (:mod:`outbox.runs.children`); its key's run, if started
    already, must have been started with the same checkpoint."""
    if not idempotency_key:
        raise ConfigurationError("idempotency_key must be a non-empty string")
    values = select(
        literal(uuid.uuid4()), literal(workflow), literal(workflow_version),
        literal(prompt_version), literal(tool_schema_version),
        literal(RunState.QUEUED.value), checkpoint_value(checkpoint, settings),
        literal(idempotency_key), literal(parent_id, runs.c.parent_id.type),
    ).where(~exists(
        select(workflows.c.name).where(workflows.c.name == workflow,
                                       workflows.c.retired_at.is_not(None))))
    inserted = (
        pg_insert(runs)
        .from_select(["id", "workflow", "workflow_version", "prompt_version",
                      "tool_schema_version", "state", "checkpoint", "idempotency_key",
                      "parent_id"], values)
        .on_conflict_do_nothing(index_elements=[runs.c.idempotency_key])
        .returning(*runs.c, literal(None).label("from_state"))
        .cte("inserted")
    )
    history = fencing.history_insert(
        inserted, [fencing.HistoryRow(RunState.QUEUED, reason="started", actor="start_run")]
    )
    # The wake-up is one more select-list item: a row only when a run was inserted (a
    # repeated key wakes nobody), delivered at commit.
    started = select(inserted, wakeups.notify(inserted.c.workflow, settings)) if notify \
        else select(inserted)
    rows = yield started.add_cte(history.cte("hist"))
    if rows:
        return Run.from_row(rows[0])
    # The checkpoints compared as jsonb (both through one serialiser): a child started again
    # with the same input is the same child whatever its JSON spelling.
    same = runs.c.checkpoint.is_not_distinct_from(checkpoint_value(checkpoint, settings))
    rows = yield select(runs, same.label("same_input")).where(
        runs.c.idempotency_key == idempotency_key)
    if rows:
        existing = Run.from_row(rows[0])
        if existing.workflow != workflow:
            raise ConfigurationError(
                f"idempotency key {idempotency_key!r} already started run {existing.id} of "
                f"workflow {existing.workflow!r}, not {workflow!r}: use a key unique per workflow"
            )
        if parent_id is not None and not rows[0]["same_input"]:
            raise ConfigurationError(
                f"child key {idempotency_key!r} already started run {existing.id} with another "
                "checkpoint: a child's key names one input (use a new key for new input)")
        return existing
    rows = yield select(workflows.c.retired_reason).where(workflows.c.name == workflow)
    raise WorkflowRetired(workflow, rows[0]["retired_reason"] if rows else None)


def _claim_once(
    worker: str, lease_seconds: float, names: Sequence[str] | None,
    settings: OutboxSettings | None,
) -> Plan[Claim | None]:
    schema = (settings or default_settings()).schema_name
    rows = yield _claim_statement(worker, lease_seconds,
                                  None if names is None else tuple(names), schema)
    if rows[0]["id"] is None:
        return None
    return Claim(Run.from_row(rows[0]), _lease_from(rows[0]))


# A worker claims with the same name, lease and workflows every time. The claim is the named
# query ``claim_run`` (outbox/db/queries.sql), sent to psycopg as is: built with Core it cost
# ~0.5 ms of client CPU per claim (the expanding parameters rendered anew on every execution,
# and a text over psycopg's 4096-character parse cache), about what PostgreSQL spends on it.
@functools.lru_cache(maxsize=256)
def _claim_statement(
    worker: str, lease_seconds: float, names: tuple[str, ...] | None, schema: str
) -> DriverStatement:
    params = {"worker": worker, "lease": timedelta(seconds=lease_seconds),
              "workflows": None if names is None else list(names)}
    return DriverStatement(driver_sql("outbox.db", "claim_run", schema), params)


def _pinned(run: Run) -> dict[str, str | None]:
    return {"workflow_version": run.workflow_version, "prompt_version": run.prompt_version,
            "tool_schema_version": run.tool_schema_version}


def _runs_as_pinned(claim: Claim, given: Sequence[Workflow]) -> bool:
    """True when one of the *given* versions of the run's workflow is the one it is pinned to."""
    run = claim.run
    return any(w.name == run.workflow and w.version_change(_pinned(run)) is None for w in given)


def _apply_version_policy(claim: Claim, workflow: Workflow,
                          settings: OutboxSettings | None) -> Plan[Claim | None]:
    run, lease = claim.run, claim.lease
    change = workflow.version_change(_pinned(run))
    if change is None or run.compensating_since is not None:  # undoing runs no workflow code
        return claim
    policy = VersionPolicy(workflow.on_version_change)
    running = {RunState.RUNNING.value}
    if policy is VersionPolicy.NEEDS_REVIEW:
        reason = f"pinned version differs from the running code ({change}); review it"
        yield from transition_plan(lease, RunState.NEEDS_HUMAN, step=None, reason=reason,
                                   evidence={"version_change": change}, actor=lease.owner,
                                   checkpoint=KEEP, wake_at=None, settings=settings)
        return None
    values: dict[str, Any] = {}
    if policy is VersionPolicy.MIGRATE:
        assert workflow.migrate is not None
        try:
            values["checkpoint"] = checkpoint_value(
                workflow.migrate(run.checkpoint, run.workflow_version), settings)
        except Exception as exc:  # the user's function: any error, CheckpointTooLarge too
            # Raised, it would abort every claim that meets this run, on every worker.
            described = f"{type(exc).__name__}: {exc}"[:500]
            yield from transition_plan(
                lease, RunState.NEEDS_HUMAN, step=None,
                reason=f"migrating the checkpoint ({change}) failed: {described}",
                evidence={"version_change": change, "policy": policy.value,
                          "error": described},
                actor=lease.owner, checkpoint=KEEP, wake_at=None, settings=settings)
            return None
        values.update(workflow_version=workflow.version)
        if workflow.prompt_version is not None:
            values["prompt_version"] = workflow.prompt_version
        if workflow.tool_schema_version is not None:
            values["tool_schema_version"] = workflow.tool_schema_version
        note = f"checkpoint migrated ({change})"
    else:
        note = f"continuing under the running code ({change})"
    stmt = fencing.statement(
        run.id, lease=lease, sources=running, values=values,
        history=[fencing.HistoryRow(RunState.RUNNING, reason=note, actor=lease.owner,
                                    evidence={"version_change": change, "policy": policy.value})],
    )
    row = yield from fencing.write(stmt, run.id, lease, RunState.RUNNING, running)
    assert row is not None
    return Claim(Run.from_row(row), fencing.next_lease(lease, row))


def claim_plan(
    *, worker: str, lease_seconds: float, workflows: Sequence[str | Workflow] | None,
    settings: OutboxSettings | None,
) -> Plan[Claim | None]:
    attempt = yield from claim_attempt_plan(worker=worker, lease_seconds=lease_seconds,
                                            workflows=workflows, settings=settings)
    return attempt.claim


def claim_attempt_plan(
    *, worker: str, lease_seconds: float, workflows: Sequence[str | Workflow] | None,
    settings: OutboxSettings | None,
) -> Plan[ClaimAttempt]:
    """:func:`claim_plan` saying how many runs the version policy set aside (a worker that
    got none after skipping some looks again at once: newer runs may be behind them)."""
    if lease_seconds <= 0:
        raise ConfigurationError(f"lease_seconds must be > 0, got {lease_seconds}")
    if not worker:
        raise ConfigurationError("worker must name the claiming worker (non-empty)")
    names = None if workflows is None else list(dict.fromkeys(
        w if isinstance(w, str) else w.name for w in workflows))
    # Several versions of one workflow may be given (a worker running each): a run pinned to
    # any of them runs as is; the others get the policy of the last one given (the newest).
    given = [w for w in workflows or () if isinstance(w, Workflow)]
    code = {w.name: w for w in given}
    skipped = 0
    for _ in range(MAX_POLICY_SKIPS):
        claim = yield from _claim_once(worker, lease_seconds, names, settings)
        if claim is None:
            return ClaimAttempt(None, skipped)
        if (workflow := code.get(claim.run.workflow)) is None or _runs_as_pinned(claim, given):
            return ClaimAttempt(claim, skipped)
        resumed = yield from _apply_version_policy(claim, workflow, settings)
        if resumed is not None:
            return ClaimAttempt(resumed, skipped)
        skipped += 1
    return ClaimAttempt(None, skipped)


def _target_values(to: RunState) -> dict[str, Any]:
    values: dict[str, Any] = {"state": to.value}
    if to is not RunState.RUNNING:
        values.update(fencing.lease_values(clear=True))
    if to in FINISHED:
        values["finished_at"] = func.now()
    return values


def wake_value(wake_at: datetime | timedelta | None, *, aware: bool = False) -> Any:
    """*wake_at* as a SQL value: a delay from the database's ``now()``, or the time given
    (*aware*: refused without a time zone, which the session's would otherwise supply)."""
    if isinstance(wake_at, timedelta):
        return func.now() + wake_at
    if aware and wake_at is not None and wake_at.tzinfo is None:
        raise ConfigurationError("until must be timezone-aware (e.g. datetime.now(UTC) + ...)")
    return wake_at


def transition_plan(
    lease: Lease, to: RunState | str, *, step: str | None, reason: str | None, evidence: Any,
    actor: str | None, checkpoint: Any, wake_at: datetime | timedelta | None,
    settings: OutboxSettings | None, log: runlog.Log | None = None,
) -> Plan[Lease]:
    if RunState(to) is RunState.FAILED and (yield from compensation.failing_plan(
            lease.run_id)) == "compensate":
        if log:
            raise ConfigurationError("a move to failed that compensates takes no log entries")
        # A run that fails with effects to undo compensates first (it ends failed after).
        return (yield from compensation.begin_leased_plan(
            lease, reason=reason or "the step moved the run to failed", evidence=evidence,
            actor=actor, step=step, settings=settings, checkpoint=checkpoint))
    # One named query sent straight to psycopg (outbox.runs.moves): the end of every step.
    rows = yield moves.statement(lease, to, step=step, reason=reason, evidence=evidence,
                                 actor=actor, checkpoint=checkpoint, wake_at=wake_at,
                                 settings=settings, log=log)
    if (moved := moves.moved_lease(lease, rows[0])) is None:
        running = {RunState.RUNNING.value}
        yield from fencing.explain(lease.run_id, lease, RunState(to).value, running)
        raise AssertionError("explain raises for a missed fenced write")  # pragma: no cover
    return moved


def renew_plan(lease: Lease, lease_seconds: float) -> Plan[Lease]:
    if lease_seconds <= 0:
        raise ConfigurationError(f"lease_seconds must be > 0, got {lease_seconds}")
    running = {RunState.RUNNING.value}
    stmt = fencing.statement(
        lease.run_id, lease=lease, sources=running,
        values={"lease_expires_at": func.now() + timedelta(seconds=lease_seconds)},
    )
    row = yield from fencing.write(stmt, lease.run_id, lease, RunState.RUNNING, running)
    assert row is not None
    return fencing.next_lease(lease, row)


def release_plan(lease: Lease, reason: str | None) -> Plan[None]:
    running = {RunState.RUNNING.value}
    note = reason or f"released by {lease.owner}"
    stmt = fencing.statement(
        lease.run_id, lease=lease, sources=running,
        values={"lease_owner": None, "lease_expires_at": func.now()},
        history=[fencing.HistoryRow(RunState.RUNNING, reason=note, actor=lease.owner)],
    )
    yield from fencing.write(stmt, lease.run_id, lease, RunState.RUNNING, running)
    return None


def move_plan(
    run_id: uuid.UUID, to: RunState | str, *, actor: str, reason: str | None, evidence: Any,
    not_before: datetime | timedelta | None, settings: OutboxSettings | None = None,
    notify: bool = True,
) -> Plan[Run]:
    target = RunState(to)
    if target is RunState.RUNNING:
        raise IllegalTransition(run_id, "?", target.value,
                                "a run becomes running only by claim(), which gives a lease")
    if target is RunState.DONE and evidence is None:
        raise EvidenceRequired(run_id, target.value)
    allowed = {s.value for s in sources(target)}
    values = _target_values(target)
    values["reason"] = reason
    if evidence is not None:
        values["last_evidence"] = evidence
    where: list[ColumnElement[bool]] = [
        # a live lease belongs to a worker: only it moves the run (or wait until it expires)
        (runs.c.state != RunState.RUNNING)
        | (func.coalesce(runs.c.lease_expires_at, func.now()) <= func.now()),
    ]
    if target is RunState.QUEUED:
        values.update(attempts=0, finished_at=None, not_before=wake_value(not_before),
                      # a requeue restarts an undoing's clock (how long it waits to learn)
                      compensating_since=case((runs.c.compensating_since.is_(None), None),
                                              else_=func.now()))
        where.append(~fencing.retired_clause() | runs.c.compensating_since.is_not(None))
    failing = (yield from compensation.failing_plan(run_id)) if target is RunState.FAILED \
        else None
    if failing == "compensating":
        state = (yield from get_run_plan(run_id)).state
        raise compensation.refuse_failing(run_id, state.value)
    if target is RunState.FAILED:
        where += compensation.plainly_failed() if failing is None else []
    if failing == "compensate":
        row = yield from compensation.begin_plan(
            run_id, lease=None, sources=allowed, reason=reason or f"failed by {actor}",
            evidence=evidence, actor=actor, settings=settings, notify=notify, where=tuple(where))
    else:
        stmt = fencing.statement(
            run_id, lease=None, sources=allowed, values=values, where=where,
            history=[fencing.HistoryRow(target, reason=reason, evidence=evidence, actor=actor)],
            woken=wakeups.woken(settings) if notify and target is RunState.QUEUED else None,
        )
        row = yield from fencing.write(stmt, run_id, None, target, allowed)
    if row is None:  # only the live-lease condition is left to explain the miss
        raise IllegalTransition(run_id, RunState.RUNNING.value, target.value,
                                "a worker holds its lease; let it move the run, or wait until "
                                "the lease expires")
    return Run.from_row(row)


def wake_plan(run_id: uuid.UUID, at: datetime | timedelta | None,
              settings: OutboxSettings | None = None, notify: bool = True) -> Plan[Run]:
    waiting = {RunState.WAITING.value}
    when = func.now() if at is None else wake_value(at)
    stmt = fencing.statement(run_id, lease=None, sources=waiting, values={"not_before": when},
                             woken=wakeups.woken(settings) if notify else None)
    row = yield from fencing.write(stmt, run_id, None, RunState.RUNNING, waiting)
    assert row is not None
    return Run.from_row(row)


def get_run_plan(run_id: uuid.UUID) -> Plan[Run]:
    rows = yield select(runs).where(runs.c.id == run_id)
    if not rows:
        raise RunNotFound(run_id)
    return Run.from_row(rows[0])


def list_runs_plan(state: RunState | str | None, workflow: str | None,
                   run_id: uuid.UUID | None, limit: int) -> Plan[list[RunView]]:
    if limit <= 0:
        raise ConfigurationError(f"limit must be > 0, got {limit}")
    size = func.octet_length(cast(runs.c.checkpoint, Text))
    query = (select(runs, size.label("checkpoint_bytes"))
             .order_by(runs.c.updated_at.desc(), runs.c.id).limit(limit))
    if state is not None:
        query = query.where(runs.c.state == RunState(state).value)
    if workflow is not None:
        query = query.where(runs.c.workflow == workflow)
    if run_id is not None:
        query = query.where(runs.c.id == run_id)
    rows = yield query
    return [RunView(Run.from_row(row), row["lease_owner"], row["lease_expires_at"],
                    row["checkpoint_bytes"]) for row in rows]


def history_plan(run_id: uuid.UUID) -> Plan[list[Transition]]:
    t = run_transitions
    rows = yield select(t).where(t.c.run_id == run_id).order_by(t.c.id)
    return [Transition(**dict(row)) for row in rows]


# --- the sync API ---------------------------------------------------------------------


def start_run(
    conn: SyncConn,
    *,
    workflow: str,
    workflow_version: str,
    idempotency_key: str,
    checkpoint: Any = None,
    prompt_version: str | None = None,
    tool_schema_version: str | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> Run:
    """Queue a run of *workflow*, or return the run *idempotency_key* already started.

    Never commits. The key is kept forever, even after retention purged the run (then
    ``run.purged`` is true): a reused key never starts the work again. Raises
    :class:`WorkflowRetired` for a retired workflow and :class:`CheckpointTooLarge`.
    A new run wakes idle workers at commit (:mod:`outbox.runs.wakeups`); ``notify=False``
    for a transaction that will be prepared (PostgreSQL refuses PREPARE after a NOTIFY).
    """
    return run_plan(conn, start_run_plan(
        workflow=workflow, workflow_version=workflow_version, idempotency_key=idempotency_key,
        checkpoint=checkpoint, prompt_version=prompt_version,
        tool_schema_version=tool_schema_version, settings=settings, notify=notify), settings)


def claim(
    conn: SyncConn,
    *,
    worker: str,
    lease_seconds: float,
    workflows: Sequence[str | Workflow] | None = None,
    settings: OutboxSettings | None = None,
) -> Claim | None:
    """Lease one runnable run to *worker*, or return ``None``; never commits.

    Runnable: ``queued`` whose ``not_before`` passed, ``waiting`` whose wake-up time
    passed, or ``running`` whose lease expired (it stays running; the history says who
    took it over). Rows locked by other claimers are skipped (``FOR UPDATE SKIP LOCKED``),
    the lease token grows by one, times come from the database clock. Runs of retired
    workflows are never claimed. Pass :class:`Workflow` objects to apply their version
    policy to runs pinned to other versions (several versions of one workflow: runs pinned
    to any of them are claimed as they are, the others get the last one's policy). Commit
    promptly: the row stays locked until then.
    """
    return run_plan(conn, claim_plan(worker=worker, lease_seconds=lease_seconds,
                                     workflows=workflows, settings=settings), settings)


def transition(
    conn: SyncConn,
    lease: Lease,
    to: RunState | str,
    *,
    step: str | None = None,
    reason: str | None = None,
    evidence: Any = None,
    actor: str | None = None,
    checkpoint: Any = KEEP,
    wake_at: datetime | timedelta | None = None,
    settings: OutboxSettings | None = None,
    log: runlog.Log | None = None,
) -> Lease:
    """Move the leased run to *to* and append its history row, in one statement; never commits.

    ``done`` needs *evidence*. Leaving ``running`` ends the lease (the returned lease only
    proves the move). ``waiting`` runs are claimable again after *wake_at* (or after
    :func:`wake`). Raises :class:`LeaseLost`, :class:`IllegalTransition`,
    :class:`EvidenceRequired`, :class:`CheckpointTooLarge`; then nothing was written. *log*:
    entries of the run's log written in the same statement (as :func:`save_checkpoint`'s).
    """
    return run_plan(conn, transition_plan(
        lease, to, step=step, reason=reason, evidence=evidence, actor=actor,
        checkpoint=checkpoint, wake_at=wake_at, settings=settings, log=log), settings)


def save_checkpoint(conn: SyncConn, lease: Lease, checkpoint: Any, *, step: str | None = None,
                    log: runlog.Log | None = None,
                    settings: OutboxSettings | None = None) -> Lease:
    """Store *checkpoint* (and *step*) for the leased run; never commits. *log*: entries of
    the run's log (:mod:`outbox.runs.runlog`) written in the same fenced statement."""
    sql, params = runlog.save_statement(lease, checkpoint, step, log, settings)
    connection = conn.connection() if isinstance(conn, Session) else conn
    try:
        row = driver_row(connection, sql, params)
    except ProgrammingError as exc:
        if (translated := missing_schema(exc, settings)) is None:
            raise
        raise translated from exc
    if (saved := runlog.saved_lease(lease, row)) is None:
        running = {RunState.RUNNING.value}
        run_plan(conn, fencing.explain(lease.run_id, lease, RunState.RUNNING.value, running),
                 settings)
        raise AssertionError("explain raises for a missed fenced write")  # pragma: no cover
    failpoint("outbox.after_checkpoint")
    return saved


def renew(conn: SyncConn, lease: Lease, lease_seconds: float, *,
          settings: OutboxSettings | None = None) -> Lease:
    """Heartbeat: extend the lease to ``now() + lease_seconds``; never commits."""
    return run_plan(conn, renew_plan(lease, lease_seconds), settings)


def release(conn: SyncConn, lease: Lease, *, reason: str | None = None,
            settings: OutboxSettings | None = None) -> None:
    """Give the run back (it stays ``running`` with an expired lease, claimable at once);
    never commits."""
    run_plan(conn, release_plan(lease, reason), settings)


def move(
    conn: SyncConn,
    run_id: uuid.UUID,
    to: RunState | str,
    *,
    actor: str,
    reason: str | None = None,
    evidence: Any = None,
    not_before: datetime | timedelta | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> Run:
    """Move a run nobody holds a lease on (an operator's action, e.g. requeue a failed run).

    Never commits. Refuses runs whose worker's lease is still live, moves not in the table,
    purged runs, and requeues of retired workflows (:class:`WorkflowRetired`). A requeue
    wakes an idle worker at commit (:mod:`outbox.runs.wakeups`); ``notify=False`` for a
    transaction that will be prepared (PostgreSQL refuses PREPARE after a NOTIFY).
    """
    return run_plan(conn, move_plan(run_id, to, actor=actor, reason=reason, evidence=evidence,
                                    not_before=not_before, settings=settings, notify=notify),
                    settings)


def wake(conn: SyncConn, run_id: uuid.UUID, *, at: datetime | timedelta | None = None,
         settings: OutboxSettings | None = None, notify: bool = True) -> Run:
    """Make a ``waiting`` run claimable at *at* (default: now); never commits. It wakes an
    idle worker at commit; ``notify=False`` for a transaction that will be prepared."""
    return run_plan(conn, wake_plan(run_id, at, settings, notify), settings)


def get_run(conn: SyncConn, run_id: uuid.UUID, *,
            settings: OutboxSettings | None = None) -> Run:
    """The run as stored (:class:`RunNotFound` if there is none)."""
    return run_plan(conn, get_run_plan(run_id), settings)


def list_runs(conn: SyncConn, *, state: RunState | str | None = None,
              workflow: str | None = None, limit: int = 50,
              settings: OutboxSettings | None = None) -> list[RunView]:
    """Runs, most recently updated first, with their lease holders (filter by state/workflow)."""
    return run_plan(conn, list_runs_plan(state, workflow, None, limit), settings)


def view_run(conn: SyncConn, run_id: uuid.UUID, *,
             settings: OutboxSettings | None = None) -> RunView:
    """One run with its lease holder and checkpoint size (:class:`RunNotFound` if none)."""
    found = run_plan(conn, list_runs_plan(None, None, run_id, 1), settings)
    if not found:
        raise RunNotFound(run_id)
    return found[0]


def history(conn: SyncConn, run_id: uuid.UUID, *,
            settings: OutboxSettings | None = None) -> list[Transition]:
    """The run's history rows, oldest first."""
    return run_plan(conn, history_plan(run_id), settings)
