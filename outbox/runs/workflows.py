"""Workflow definitions: name, code version, what to do with runs pinned to another version.

A run pins the workflow version (and prompt / tool-schema versions) it started under.
When a worker running other code claims it, the workflow's :class:`VersionPolicy` decides:
``continue`` under the new code, ``migrate`` the checkpoint with your function, or
``needs-review`` (the run goes to ``needs-human``). Retired workflows accept no work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import workflows as workflows_table
from outbox.errors import ConfigurationError
from outbox.runs.retry import RetryPolicy
from outbox.settings import OutboxSettings

Migration = Callable[[Any, str], Any]
"""``migrate(checkpoint, from_version) -> new checkpoint``."""


class VersionPolicy(StrEnum):
    """What a worker does with a run pinned to another version of the workflow."""

    CONTINUE = "continue"
    MIGRATE = "migrate"
    NEEDS_REVIEW = "needs-review"


@dataclass(frozen=True, kw_only=True)
class Workflow:
    """A workflow as the running code defines it."""

    name: str
    version: str
    on_version_change: VersionPolicy = VersionPolicy.NEEDS_REVIEW
    migrate: Migration | None = None
    prompt_version: str | None = None
    tool_schema_version: str | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    step_retry: Mapping[str, RetryPolicy] = field(default_factory=dict)
    retired: bool = False
    retired_reason: str | None = None
    signals: frozenset[str] | None = None
    """The signal names its runs take (``None``: any; see :mod:`outbox.runs.signals`)."""

    def __post_init__(self) -> None:
        if not self.name or not self.version:
            raise ConfigurationError("a workflow needs a non-empty name and version")
        if VersionPolicy(self.on_version_change) is VersionPolicy.MIGRATE and self.migrate is None:
            raise ConfigurationError(
                f"workflow {self.name!r} uses on_version_change='migrate' but has no migrate "
                "function: pass migrate=lambda checkpoint, from_version: ..."
            )

    def retry_for(self, step: str | None) -> RetryPolicy:
        """The retry policy of *step* (falling back to the workflow's)."""
        return self.step_retry.get(step, self.retry) if step is not None else self.retry

    def version_change(self, run: Mapping[str, Any]) -> str | None:
        """How *run*'s pinned versions differ from this code, or ``None`` if they match."""
        changes = []
        for column, mine in (("workflow_version", self.version),
                             ("prompt_version", self.prompt_version),
                             ("tool_schema_version", self.tool_schema_version)):
            pinned = run.get(column)
            if mine is not None and pinned != mine:
                changes.append(f"{column} {pinned} -> {mine}")
        return ", ".join(changes) or None


def register_plan(workflow: Workflow, *, keep_retirement: bool = False) -> Plan[None]:
    """*keep_retirement*: a workflow not retired in *workflow* leaves a retirement recorded
    by an operator in place (a worker's start-up registration: code never un-retires)."""
    wf = workflows_table
    retired_at = func.now() if workflow.retired else None
    stmt = pg_insert(wf).values(
        name=workflow.name, version=workflow.version, retired_at=retired_at,
        retired_reason=workflow.retired_reason if workflow.retired else None,
    )
    changes: dict[str, Any] = {"version": stmt.excluded.version, "updated_at": func.now()}
    if workflow.retired or not keep_retirement:
        changes.update({
            # keep the first retirement time when it is registered as retired again
            "retired_at": case((stmt.excluded.retired_at.is_(None), None),
                               else_=func.coalesce(wf.c.retired_at, stmt.excluded.retired_at)),
            "retired_reason": stmt.excluded.retired_reason,
        })
    yield stmt.on_conflict_do_update(index_elements=[wf.c.name], set_=changes)
    return None


def retire_plan(name: str, reason: str) -> Plan[None]:
    wf = workflows_table
    rows = yield (
        update(wf).where(wf.c.name == name)
        .values(retired_at=func.coalesce(wf.c.retired_at, func.now()), retired_reason=reason,
                updated_at=func.now())
        .returning(wf.c.name)
    )
    if not rows:
        raise ConfigurationError(f"workflow {name!r} is not registered: register() it first")
    return None


def is_retired_plan(name: str) -> Plan[bool]:
    wf = workflows_table
    rows = yield select(wf.c.retired_at).where(wf.c.name == name)
    return bool(rows) and rows[0]["retired_at"] is not None


def register(conn: SyncConn, workflow: Workflow, *,
             settings: OutboxSettings | None = None) -> None:
    """Record *workflow*'s current version and retirement in the caller's transaction
    (never commits)."""
    run_plan(conn, register_plan(workflow), settings)


def retire(conn: SyncConn, name: str, *, reason: str,
           settings: OutboxSettings | None = None) -> None:
    """Retire workflow *name*: its runs are no longer started, claimed or requeued
    (never commits)."""
    run_plan(conn, retire_plan(name, reason), settings)


def is_retired(conn: SyncConn, name: str, *, settings: OutboxSettings | None = None) -> bool:
    """True when workflow *name* is registered as retired."""
    return run_plan(conn, is_retired_plan(name), settings)
