"""Human approvals a run waits for, and their revalidation when the run resumes.

An approval has a *scope* (what it allows, as JSON) and an expiry. A worker requests one,
moves the run to ``waiting``; :func:`grant` wakes the run. On resume the worker calls
:func:`revalidate`: an approval that expired, was revoked or does not cover what the run is
about to do sends the run to ``needs-human`` with that reason, and the run does not go on.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, literal, select, update

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import agent_runs, approvals
from outbox.errors import ApprovalInvalid, ConfigurationError, RunNotFound
from outbox.runs import wakeups
from outbox.runs.checkpoints import KEEP
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import transition_plan
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings


@dataclass(frozen=True)
class Approval:
    """An approval as stored."""

    id: uuid.UUID
    run_id: uuid.UUID
    scope: Any
    requested_at: datetime
    expires_at: datetime
    granted_by: str | None
    granted_at: datetime | None
    revoked_by: str | None
    revoked_at: datetime | None
    reason: str | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Approval:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ApprovalCheck:
    """The verdict of :func:`revalidate`. When not ``valid`` the run was moved to ``state``
    (``needs-human``, or ``waiting`` while the approval is still pending): stop and commit."""

    valid: bool
    state: RunState
    reason: str | None
    lease: Lease


def covers(granted: Any, required: Mapping[str, Any]) -> str | None:
    """Why *granted* scope does not cover *required*, or ``None`` when it does.

    Every key of *required* must be in *granted* with the same value; a list in *granted*
    allows any of its members (or a sub-list).
    """
    if not isinstance(granted, Mapping):
        return "the approved scope is not an object"
    for key, wanted in required.items():
        if key not in granted:
            return f"out of scope: {key!r} was not approved"
        allowed = granted[key]
        if isinstance(allowed, list):
            items = wanted if isinstance(wanted, list) else [wanted]
            if any(item not in allowed for item in items):
                return f"out of scope: {key}={wanted!r} not in the approved {allowed!r}"
        elif allowed != wanted:
            return f"out of scope: {key}={wanted!r} but {allowed!r} was approved"
    return None


def request_plan(run_id: uuid.UUID, scope: Mapping[str, Any], expires_at: datetime | timedelta,
                 reason: str | None) -> Plan[Approval]:
    if not isinstance(scope, Mapping):
        raise ConfigurationError("an approval scope is a JSON object (a mapping)")
    expiry = (func.now() + expires_at if isinstance(expires_at, timedelta)
              else literal(expires_at, approvals.c.expires_at.type))
    # INSERT … SELECT from the run: an unknown run inserts nothing (RunNotFound) instead of
    # failing the foreign key, which would abort the caller's whole transaction.
    rows = yield approvals.insert().from_select(
        ["id", "run_id", "scope", "expires_at", "reason"],
        select(
            literal(uuid.uuid4(), approvals.c.id.type), agent_runs.c.id,
            literal(dict(scope), approvals.c.scope.type), expiry,
            literal(reason, approvals.c.reason.type),
        ).where(agent_runs.c.id == run_id),
    ).returning(*approvals.c)
    if not rows:
        raise RunNotFound(run_id)
    return Approval.from_row(rows[0])


def _settle(approval_id: uuid.UUID) -> Plan[Approval]:
    """Explain a grant/revoke that matched no row (or return the already-granted approval)."""
    rows = yield select(approvals, func.now().label("db_now")).where(approvals.c.id == approval_id)
    if not rows:
        raise ApprovalInvalid(approval_id, "there is no such approval")
    row = rows[0]
    if row["revoked_at"] is not None:
        raise ApprovalInvalid(approval_id, f"it was revoked by {row['revoked_by']}")
    if row["expires_at"] <= row["db_now"]:
        raise ApprovalInvalid(approval_id, f"it expired at {row['expires_at'].isoformat()}")
    return Approval.from_row(row)


def grant_plan(approval_id: uuid.UUID, by: str, settings: OutboxSettings | None = None,
               notify: bool = True) -> Plan[Approval]:
    granted = (
        update(approvals)
        .where(approvals.c.id == approval_id, approvals.c.revoked_at.is_(None),
               approvals.c.granted_at.is_(None), approvals.c.expires_at > func.now())
        .values(granted_by=by, granted_at=func.now())
        .returning(*approvals.c)
        .cte("granted")
    )
    wake = (
        update(agent_runs)
        .where(agent_runs.c.id == granted.c.run_id, agent_runs.c.state == RunState.WAITING.value)
        .values(not_before=func.now(), version=agent_runs.c.version + 1, updated_at=func.now())
    )
    if notify:  # an idle worker claims the woken run at once, not at its next poll
        woke = wake.returning(wakeups.notify(agent_runs.c.workflow, settings)).cte("wake")
        rows = yield select(granted, select(func.count()).select_from(woke)
                            .scalar_subquery().label("woken"))
    else:
        rows = yield select(granted).add_cte(wake.cte("wake"))
    if rows:
        return Approval.from_row(rows[0])
    return (yield from _settle(approval_id))


def revoke_plan(approval_id: uuid.UUID, by: str, reason: str | None) -> Plan[Approval]:
    rows = yield (
        update(approvals)
        .where(approvals.c.id == approval_id, approvals.c.revoked_at.is_(None))
        .values(revoked_by=by, revoked_at=func.now(),
                reason=func.coalesce(reason, approvals.c.reason))
        .returning(*approvals.c)
    )
    if not rows:
        return (yield from _settle(approval_id))  # raises: missing or already revoked
    return Approval.from_row(rows[0])


def revalidate_plan(lease: Lease, approval_id: uuid.UUID, scope: Mapping[str, Any],
                    settings: OutboxSettings | None) -> Plan[ApprovalCheck]:
    rows = yield select(approvals, func.now().label("db_now")).where(
        approvals.c.id == approval_id, approvals.c.run_id == lease.run_id)
    if rows and rows[0]["granted_at"] is None and rows[0]["revoked_at"] is None \
            and rows[0]["expires_at"] > rows[0]["db_now"]:
        expiry = rows[0]["expires_at"]
        reason = f"approval {approval_id} is not granted yet; waiting until {expiry.isoformat()}"
        lease = yield from transition_plan(
            lease, RunState.WAITING, step=None, reason=reason, evidence=None,
            actor=lease.owner, checkpoint=KEEP, wake_at=expiry, settings=settings)
        return ApprovalCheck(False, RunState.WAITING, reason, lease)
    if not rows:
        problem: str | None = "does not exist for this run"
    elif (row := rows[0])["revoked_at"] is not None:
        problem = f"was revoked by {row['revoked_by']}" + (
            f": {row['reason']}" if row["reason"] else "")
    elif row["expires_at"] <= row["db_now"]:
        problem = f"expired at {row['expires_at'].isoformat()}"
    else:
        problem = covers(row["scope"], scope)
    if problem is None:
        return ApprovalCheck(True, RunState.RUNNING, None, lease)
    reason = f"approval {approval_id} {problem}"
    lease = yield from transition_plan(
        lease, RunState.NEEDS_HUMAN, step=None, reason=reason,
        evidence={"approval_id": str(approval_id), "problem": problem, "scope": dict(scope)},
        actor=lease.owner, checkpoint=KEEP, wake_at=None, settings=settings)
    return ApprovalCheck(False, RunState.NEEDS_HUMAN, reason, lease)


def list_plan(run_id: uuid.UUID | None, pending: bool, limit: int) -> Plan[list[Approval]]:
    query = select(approvals).order_by(approvals.c.requested_at.desc()).limit(limit)
    if run_id is not None:
        query = query.where(approvals.c.run_id == run_id)
    if pending:
        query = query.where(approvals.c.granted_at.is_(None), approvals.c.revoked_at.is_(None),
                            approvals.c.expires_at > func.now())
    rows = yield query
    return [Approval.from_row(row) for row in rows]


def list_approvals(conn: SyncConn, *, run_id: uuid.UUID | None = None, pending: bool = False,
                   limit: int = 50, settings: OutboxSettings | None = None) -> list[Approval]:
    """The latest approvals (of *run_id*; only those still waiting for a person with
    *pending*), newest first."""
    return run_plan(conn, list_plan(run_id, pending, limit), settings)


def request_approval(conn: SyncConn, run_id: uuid.UUID, *, scope: Mapping[str, Any],
                     expires_at: datetime | timedelta, reason: str | None = None,
                     settings: OutboxSettings | None = None) -> Approval:
    """Ask for an approval of *scope* valid until *expires_at* (or now + a timedelta);
    never commits. Then move the run to ``waiting``: :func:`grant` wakes it."""
    return run_plan(conn, request_plan(run_id, scope, expires_at, reason), settings)


def grant(conn: SyncConn, approval_id: uuid.UUID, *, by: str,
          settings: OutboxSettings | None = None, notify: bool = True) -> Approval:
    """Grant the approval and wake its waiting run (an idle worker is NOTIFYed: ``notify=
    False`` for a transaction that will be prepared); never commits. Raises
    :class:`ApprovalInvalid` if it expired, was revoked or does not exist."""
    return run_plan(conn, grant_plan(approval_id, by, settings, notify), settings)


def revoke(conn: SyncConn, approval_id: uuid.UUID, *, by: str, reason: str | None = None,
           settings: OutboxSettings | None = None) -> Approval:
    """Revoke the approval (granted or not); never commits."""
    return run_plan(conn, revoke_plan(approval_id, by, reason), settings)


def revalidate(conn: SyncConn, lease: Lease, approval_id: uuid.UUID, *,
               scope: Mapping[str, Any], settings: OutboxSettings | None = None) -> ApprovalCheck:
    """Check, on resume, that *approval_id* still allows *scope*; never commits.

    Valid: returns ``valid=True`` and writes nothing. Expired, revoked, missing or out of
    scope: moves the run to ``needs-human`` with that reason (commit that, and stop).
    Still pending: moves the run back to ``waiting`` until the approval's expiry.
    """
    return run_plan(conn, revalidate_plan(lease, approval_id, scope, settings), settings)
