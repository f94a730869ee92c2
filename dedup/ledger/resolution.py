"""A human settles what the ledger could not: list operations, confirm one, or declare it
not applied (so it is called again with the same key). Each resolution records who and why.

Functions take the caller's ``Connection``/``Session`` and never commit. The operation's
agent run moves with the resolution, in the same transaction
(:func:`dedup.ledger.operations.settle_run_plan`): a run this operation escalated to
``needs-human`` goes back to ``waiting``; confirmed, it is then finished (``done``, with the
person's evidence) or resumed, as the operation's ``on_settle`` says; not applied, it waits
for the outcome of the call the reconciler makes again.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.sql.elements import ColumnElement

from dedup.ledger.errors import ResolutionRefused
from dedup.ledger.operations import (
    SETTLED,
    Operation,
    OperationStatus,
    event_insert,
    fetch,
    get_operation,
    ops,
    settle_run_plan,
    with_run_note,
)
from dedup.ledger.outcomes import Evidence
from outbox.db.execution import SyncConn, run_plan
from outbox.runs.checkpoints import json_value
from outbox.settings import OutboxSettings


def list_operations(
    conn: SyncConn,
    *,
    status: OperationStatus | str | Collection[OperationStatus | str] | None = None,
    system: str | None = None,
    run_id: uuid.UUID | None = None,
    limit: int = 100,
    settings: OutboxSettings | None = None,
) -> list[Operation]:
    """Operations, newest first, filtered by status (one or several), system and run."""
    query = (select(ops).where(*_filters(status, system, run_id))
             .order_by(ops.c.created_at.desc(), ops.c.id.desc()).limit(limit))
    return [Operation.from_row(row) for row in fetch(conn, query, settings)]


def count_operations(
    conn: SyncConn,
    *,
    status: OperationStatus | str | Collection[OperationStatus | str] | None = None,
    system: str | None = None,
    run_id: uuid.UUID | None = None,
    settings: OutboxSettings | None = None,
) -> int:
    """How many operations :func:`list_operations` would list without a limit."""
    query = (select(func.count().label("n")).select_from(ops)
             .where(*_filters(status, system, run_id)))
    return int(fetch(conn, query, settings)[0]["n"])


def _filters(status: OperationStatus | str | Collection[OperationStatus | str] | None,
             system: str | None, run_id: uuid.UUID | None) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if status is not None:
        wanted = [status] if isinstance(status, str) else list(status)
        where.append(ops.c.status.in_([OperationStatus(s).value for s in wanted]))
    if system is not None:
        where.append(ops.c.system == system)
    if run_id is not None:
        where.append(ops.c.run_id == run_id)
    return where


def resolve_confirmed(
    conn: SyncConn,
    operation_id: uuid.UUID,
    *,
    evidence: Evidence,
    actor: str,
    reason: str,
    settings: OutboxSettings | None = None,
) -> Operation:
    """A human confirms the operation was applied, with the evidence they found (e.g. the
    supplier's order number from its portal). Never commits.

    The operation's run is settled with it (``done`` with this evidence, or resumed); a run
    this operation escalated to ``needs-human`` first goes back to ``waiting``.

    Raises:
        ResolutionRefused: already confirmed/rejected, no evidence, or no actor/reason.
    """
    current = _resolvable(conn, operation_id, actor, reason, settings)
    if evidence.is_empty():
        raise ResolutionRefused(operation_id, current.status.value,
                                "confirming needs evidence (the outside system's reference)")
    detail = {**evidence.as_json(), "reason": reason}
    return _resolve(conn, current, OperationStatus.CONFIRMED, actor=actor, reason=reason,
                    detail=detail, settings=settings,
                    reference=evidence.reference, response_digest=evidence.response_digest,
                    evidence=json_value({**evidence.as_json(), "resolved_by": actor}),
                    next_check_at=None, resolved_at=func.now())


def resolve_not_applied(
    conn: SyncConn,
    operation_id: uuid.UUID,
    *,
    actor: str,
    reason: str,
    evidence: Evidence | None = None,
    settings: OutboxSettings | None = None,
) -> Operation:
    """A human establishes the operation was **not** applied: the reconciler's next pass
    calls the system again with the same idempotency key. Never commits.

    A run this operation escalated to ``needs-human`` goes back to ``waiting``: it waits for
    the outcome of that call, which settles it as any outcome does (or escalates it again).

    Raises:
        ResolutionRefused: already confirmed/rejected, or no actor/reason.
    """
    current = _resolvable(conn, operation_id, actor, reason, settings)
    detail = {**(evidence.as_json() if evidence else {}), "reason": reason}
    return _resolve(conn, current, OperationStatus.NOT_APPLIED, actor=actor, reason=reason,
                    detail=detail, settings=settings, next_check_at=func.now())


def _resolvable(conn: SyncConn, operation_id: uuid.UUID, actor: str, reason: str,
                settings: OutboxSettings | None) -> Operation:
    current = get_operation(conn, operation_id, settings=settings)
    if not actor or not reason:
        raise ResolutionRefused(operation_id, current.status.value,
                                "say who resolves it (actor) and why (reason)")
    if current.status in SETTLED:
        raise ResolutionRefused(operation_id, current.status.value,
                                "it is already settled by the outside system's answer")
    return current


def _resolve(conn: SyncConn, current: Operation, to: OperationStatus, *, actor: str,
             reason: str, detail: dict[str, Any], settings: OutboxSettings | None,
             **values: Any) -> Operation:
    # Fenced on the version read above: a checker's concurrent answer wins, and we say so.
    rows = fetch(
        conn,
        update(ops).where(ops.c.id == current.id, ops.c.version == current.version)
        .values(status=to.value, resolved_by=actor, resolution_reason=reason,
                version=ops.c.version + 1, updated_at=func.now(), **values)
        .returning(*ops.c),
        settings,
    )
    if not rows:
        latest = get_operation(conn, current.id, settings=settings)
        raise ResolutionRefused(current.id, latest.status.value,
                                "it changed while being resolved (a checker answered); "
                                "look at it again")
    resolved = Operation.from_row(rows[0])
    run_note = run_plan(conn, settle_run_plan(resolved, actor=actor), settings)
    fetch(conn, event_insert(current.id, "resolution", to.value,
                             with_run_note(detail, run_note), actor), settings)
    return resolved
