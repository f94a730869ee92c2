"""Human approvals a run waits for, their revalidation when the run resumes, and their spending.

An approval has a *scope* (what it allows, as JSON) and an expiry. A worker requests one,
moves the run to ``waiting``; :func:`grant` wakes the run. On resume the worker calls
:func:`revalidate`: an approval that expired, was revoked or does not cover what the run is
about to do sends the run to ``needs-human`` with that reason, and the run does not go on.

A *bound* approval also keeps the digest of one exact call (:func:`call_digest` of the tool
and its arguments; the scope then shows ``{"tool": ..., "args": ...}``). The run spends it
(:func:`spend_plan`, ``job.spend_approval``) in the transaction that inserts the effect's
outbox message: one conditional UPDATE, so a second spend (a retry, a replayed history, a
forged call with other arguments) matches no row and is refused with the reason, and the
approved call is sent at most once. A spent approval cannot be revoked: its effect was sent.
Grant and revoke are conditional UPDATEs too: when they race, the row lock orders them and
the second re-checks its conditions, so the approval ends granted-then-revoked or revoked
and never granted, and each caller is told which.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import RowMapping, func, literal, select, update

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import agent_runs, approvals, outbox_messages
from outbox.errors import ApprovalInvalid, ConfigurationError, RunNotFound
from outbox.runs import fencing, wakeups
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
    digest: str | None
    """:func:`call_digest` of the one call it allows; ``None``: a loose scope, never spent."""
    grant_reason: str | None
    spent_at: datetime | None
    spent_message_id: uuid.UUID | None
    """The outbox message the approval was spent on (its effect)."""

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


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def call_digest(tool: str, args: Mapping[str, Any]) -> str:
    """The canonical digest of one call: ``"sha256:"`` and the hex SHA-256 of
    ``{"tool": tool, "args": args}`` as JSON with sorted keys, no spaces and UTF-8 text.

    *args* as JSON data (what the validated arguments dump to): the same call gives the same
    digest whatever its key order. A value JSON cannot carry exactly (NaN or infinity, a
    non-text key, an object such as a datetime or a Decimal) raises
    :class:`ConfigurationError` naming the argument: a digest must never depend on how a
    value happens to be printed.
    """
    if not isinstance(tool, str) or not tool:
        raise ConfigurationError(f"a call's tool is a non-empty name, not {tool!r}")
    if not isinstance(args, Mapping):
        raise ConfigurationError(
            f"the arguments of tool {tool!r} are a JSON object (a mapping), not "
            f"{type(args).__name__}")
    for name, value in args.items():
        if not isinstance(name, str):
            raise ConfigurationError(f"tool {tool!r} has an argument named {name!r}: "
                                     "argument names are text")
        _check_json(value, f"argument {name!r} of tool {tool!r}")
    text = json.dumps({"tool": tool, "args": args}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_json(value: Any, where: str) -> None:
    # Checked before json.dumps, which would print the key 1 as "1" (two calls, one digest)
    # and refuse NaN with a bare ValueError that does not say which argument it was.
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigurationError(f"{where} is {value!r}, which JSON cannot carry")
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigurationError(f"{where} has the key {key!r}: JSON keys are text")
            _check_json(item, f"{where}[{key!r}]")
        return
    raise ConfigurationError(
        f"{where} is a {type(value).__name__}, not JSON data: pass the arguments as JSON "
        "(e.g. a pydantic model's model_dump(mode='json'))")


def _checked_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ConfigurationError(
            f"{digest!r} is not a call digest: 'sha256:' and 64 lowercase hex digits, as "
            "call_digest(tool, args) returns")
    return digest


def _bound_scope(scope: Mapping[str, Any], digest: str) -> None:
    """Refuse a bound request whose scope (what the person is shown) is not the call its
    digest binds: the person would approve one call and the run spend another."""
    if set(scope) != {"tool", "args"}:
        raise ConfigurationError(
            "an approval with a digest shows the call it binds: its scope is "
            f'{{"tool": ..., "args": {{...}}}}, not one with the keys {sorted(scope)}')
    shown = call_digest(scope["tool"], scope["args"])
    if shown != digest:
        raise ConfigurationError(
            f"the digest {digest} is not that of the call the scope shows ({shown}): the "
            "person would approve other arguments than those the run spends it on")


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
                 reason: str | None, digest: str | None = None) -> Plan[Approval]:
    if not isinstance(scope, Mapping):
        raise ConfigurationError("an approval scope is a JSON object (a mapping)")
    if digest is not None:
        _bound_scope(scope, _checked_digest(digest))
    expiry = (func.now() + expires_at if isinstance(expires_at, timedelta)
              else literal(expires_at, approvals.c.expires_at.type))
    # INSERT … SELECT from the run: an unknown run inserts nothing (RunNotFound) instead of
    # failing the foreign key, which would abort the caller's whole transaction.
    rows = yield approvals.insert().from_select(
        ["id", "run_id", "scope", "expires_at", "reason", "digest"],
        select(
            literal(uuid.uuid4(), approvals.c.id.type), agent_runs.c.id,
            literal(dict(scope), approvals.c.scope.type), expiry,
            literal(reason, approvals.c.reason.type), literal(digest, approvals.c.digest.type),
        ).where(agent_runs.c.id == run_id),
    ).returning(*approvals.c)
    if not rows:
        raise RunNotFound(run_id)
    return Approval.from_row(rows[0])


def _current(approval_id: uuid.UUID) -> Plan[RowMapping]:
    """The approval as committed now (with ``db_now``), to explain an UPDATE that matched no
    row: a statement of its own, so it sees what a concurrent writer committed meanwhile."""
    rows = yield select(approvals, func.now().label("db_now")).where(approvals.c.id == approval_id)
    if not rows:
        raise ApprovalInvalid(approval_id, "there is no such approval")
    return rows[0]


def _spent(row: RowMapping) -> str:
    return (f"it was already spent on message {row['spent_message_id']} at "
            f"{row['spent_at'].isoformat()}")


def _settle(approval_id: uuid.UUID, digest: str | None) -> Plan[Approval]:
    """Explain a grant that matched no row (or return the approval granted already)."""
    row = yield from _current(approval_id)
    if row["revoked_at"] is not None:
        raise ApprovalInvalid(approval_id, f"it was revoked by {row['revoked_by']}")
    if row["expires_at"] <= row["db_now"]:
        raise ApprovalInvalid(approval_id, f"it expired at {row['expires_at'].isoformat()}")
    if digest is not None and row["digest"] != digest:
        raise ApprovalInvalid(
            approval_id, "the arguments shown to the person are not those the run asks for "
            f"(the run asks {row['digest'] or 'a loose scope, no digest'}; the grant was for "
            f"{digest})", hint="show the approval's own scope again and grant that")
    return Approval.from_row(row)


def grant_plan(approval_id: uuid.UUID, by: str, settings: OutboxSettings | None = None,
               notify: bool = True, *, reason: str | None = None,
               digest: str | None = None) -> Plan[Approval]:
    conditions = [approvals.c.id == approval_id, approvals.c.revoked_at.is_(None),
                  approvals.c.granted_at.is_(None), approvals.c.expires_at > func.now()]
    if digest is not None:  # the call the person was shown must be the one the run asks for
        conditions.append(approvals.c.digest == _checked_digest(digest))
    granted = (
        update(approvals)
        .where(*conditions)
        .values(granted_by=by, granted_at=func.now(), grant_reason=reason)
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
    return (yield from _settle(approval_id, digest))


def revoke_plan(approval_id: uuid.UUID, by: str, reason: str | None) -> Plan[Approval]:
    rows = yield (
        update(approvals)
        .where(approvals.c.id == approval_id, approvals.c.revoked_at.is_(None),
               approvals.c.spent_at.is_(None))
        .values(revoked_by=by, revoked_at=func.now(),
                reason=func.coalesce(reason, approvals.c.reason))
        .returning(*approvals.c)
    )
    if rows:
        return Approval.from_row(rows[0])
    row = yield from _current(approval_id)
    if row["spent_at"] is not None:
        raise ApprovalInvalid(approval_id, _spent(row) + ": the effect was sent",
                              hint="revoking it would stop nothing; undo the effect itself "
                                   "if it must be undone")
    raise ApprovalInvalid(approval_id, f"it was revoked by {row['revoked_by']}")


def spend_plan(approval_id: uuid.UUID, *, digest: str, message_id: uuid.UUID,
               lease: Lease | None = None) -> Plan[Approval]:
    """Spend the bound approval *approval_id* on outbox message *message_id*, once.

    Run it in the transaction that inserts that message: the spend and the effect commit
    together or not at all. Granted, not revoked, not expired, not spent and bound to
    *digest*, or :class:`ApprovalInvalid` says which of these failed (nothing written).
    *lease*: the run spending it, which must hold its lease and own the approval.
    """
    _checked_digest(digest)
    if lease is not None:
        yield from fencing.hold(lease)
    conditions = [approvals.c.id == approval_id, approvals.c.granted_at.is_not(None),
                  approvals.c.revoked_at.is_(None), approvals.c.expires_at > func.now(),
                  approvals.c.spent_at.is_(None), approvals.c.digest == digest]
    if lease is not None:
        conditions.append(approvals.c.run_id == lease.run_id)
    rows = yield (update(approvals).where(*conditions)
                  .values(spent_at=func.now(), spent_message_id=message_id)
                  .returning(*approvals.c))
    if rows:
        return Approval.from_row(rows[0])
    row = yield from _current(approval_id)
    raise _refusal(row, digest, None if lease is None else lease.run_id)


def _refusal(row: RowMapping, digest: str, run_id: uuid.UUID | None) -> ApprovalInvalid:
    """Why a spend matched no row, the most telling reason first."""
    hint = "request a new approval"
    if run_id is not None and row["run_id"] != run_id:
        reason = f"it was requested by run {row['run_id']}, not by run {run_id}"
    elif row["digest"] is None:
        reason = ("it approves a loose scope, not one exact call (it has no digest), so it "
                  "cannot be spent")
        hint = "request one with digest=call_digest(tool, args)"
    elif row["spent_at"] is not None:
        reason = _spent(row)
        hint = "an approved call is sent once; another needs a new approval"
    elif row["revoked_at"] is not None:
        reason = f"it was revoked by {row['revoked_by']}" + (
            f": {row['reason']}" if row["reason"] else "")
    elif row["digest"] != digest:
        reason = (f"the arguments differ from those approved (approved digest {row['digest']}, "
                  f"asked {digest})")
        hint = "send the call as approved, or request a new approval for these arguments"
    elif row["expires_at"] <= row["db_now"]:
        reason = f"it expired at {row['expires_at'].isoformat()}"
    elif row["granted_at"] is None:
        reason = "it is not granted yet"
        hint = "wait for a person to grant it (outbox approvals grant)"
    else:  # every condition holds now: a grant committed between the two statements
        reason, hint = "it changed while it was being spent", "roll back and try again"
    return ApprovalInvalid(row["id"], reason, hint=hint)


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
                     digest: str | None = None,
                     settings: OutboxSettings | None = None) -> Approval:
    """Ask for an approval of *scope* valid until *expires_at* (or now + a timedelta);
    never commits. Then move the run to ``waiting``: :func:`grant` wakes it.

    *digest*: bind it to one call, ``call_digest(tool, args)``, shown to the person as
    ``scope={"tool": tool, "args": args}`` (refused if the two differ); the run then spends it
    once, with the effect (``job.spend_approval``)."""
    return run_plan(conn, request_plan(run_id, scope, expires_at, reason, digest), settings)


def grant(conn: SyncConn, approval_id: uuid.UUID, *, by: str, reason: str | None = None,
          digest: str | None = None, settings: OutboxSettings | None = None,
          notify: bool = True) -> Approval:
    """Grant the approval, recording *by* and why (*reason*), and wake its waiting run (an
    idle worker is NOTIFYed: ``notify=False`` for a transaction that will be prepared); never
    commits. Raises :class:`ApprovalInvalid` if it expired, was revoked or does not exist,
    or if *digest* (the call the person was shown) is not the one the approval binds."""
    return run_plan(conn, grant_plan(approval_id, by, settings, notify, reason=reason,
                                     digest=digest), settings)


def revoke(conn: SyncConn, approval_id: uuid.UUID, *, by: str, reason: str | None = None,
           settings: OutboxSettings | None = None) -> Approval:
    """Revoke the approval (granted or not; not once spent: its effect was sent); never
    commits."""
    return run_plan(conn, revoke_plan(approval_id, by, reason), settings)


def revalidate(conn: SyncConn, lease: Lease, approval_id: uuid.UUID, *,
               scope: Mapping[str, Any], settings: OutboxSettings | None = None) -> ApprovalCheck:
    """Check, on resume, that *approval_id* still allows *scope*; never commits.

    Valid: returns ``valid=True`` and writes nothing. Expired, revoked, missing or out of
    scope: moves the run to ``needs-human`` with that reason (commit that, and stop).
    Still pending: moves the run back to ``waiting`` until the approval's expiry.
    """
    return run_plan(conn, revalidate_plan(lease, approval_id, scope, settings), settings)


@dataclass(frozen=True)
class ApprovalAudit:
    """Who approved which exact call, and the message it was spent on (:func:`approvals_audit`).
    ``topic`` and ``key`` are the message's while it is still in the outbox (``None`` after
    the relay's retention dropped it, or before the approval is spent)."""

    approval_id: uuid.UUID
    run_id: uuid.UUID
    tool: str | None
    args: Any
    digest: str
    requested_at: datetime
    expires_at: datetime
    granted_by: str | None
    granted_at: datetime | None
    grant_reason: str | None
    revoked_by: str | None
    revoked_at: datetime | None
    spent_at: datetime | None
    spent_message_id: uuid.UUID | None
    topic: str | None
    key: str | None


def audit_plan(run_id: uuid.UUID | None, limit: int) -> Plan[list[ApprovalAudit]]:
    if limit < 1:
        raise ConfigurationError(f"limit is at least 1, not {limit}")
    a, m = approvals, outbox_messages
    query = (
        select(a.c.id.label("approval_id"), a.c.run_id, a.c.scope["tool"].astext.label("tool"),
               a.c.scope["args"].label("args"), a.c.digest, a.c.requested_at, a.c.expires_at,
               a.c.granted_by, a.c.granted_at, a.c.grant_reason, a.c.revoked_by,
               a.c.revoked_at, a.c.spent_at, a.c.spent_message_id, m.c.topic, m.c.key)
        .select_from(a.outerjoin(m, m.c.message_id == a.c.spent_message_id))
        .where(a.c.digest.is_not(None))
        .order_by(a.c.requested_at.desc(), a.c.id.desc())
        .limit(limit)
    )
    if run_id is not None:
        query = query.where(a.c.run_id == run_id)
    rows = yield query
    # A Kafka key is bytes; shown as text, with any byte that is not UTF-8 escaped.
    return [ApprovalAudit(**{**dict(row), "key": None if row["key"] is None
                             else bytes(row["key"]).decode("utf-8", "backslashreplace")})
            for row in rows]


def approvals_audit(conn: SyncConn, *, run_id: uuid.UUID | None = None, limit: int = 100,
                    settings: OutboxSettings | None = None) -> list[ApprovalAudit]:
    """The bound approvals (those with a digest; of *run_id*), newest first: the exact call
    each allows, who granted it and why, who revoked it, and the message it was spent on."""
    return run_plan(conn, audit_plan(run_id, limit), settings)
