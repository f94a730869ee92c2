"""``outbox approvals``: what runs wait for a person to allow, granting or revoking it, and
the audit of who approved which exact call.

A durable agent's tool that requires approval (docs/agents.md), or any worker that calls
:func:`outbox.request_approval`, leaves an approval here; granting it wakes the waiting run,
which revalidates it when it resumes.
"""

from __future__ import annotations

import json
import uuid

import click

from outbox.cli.main import (
    cell,
    compact_json,
    database_url_option,
    echo_json,
    echo_table,
    one_line_errors,
    open_engine,
    who_option,
)
from outbox.cli.operator import json_option, limit_option
from outbox.runs.approvals import (
    Approval,
    ApprovalAudit,
    approvals_audit,
    grant,
    list_approvals,
    revoke,
)


def _state(approval: Approval) -> str:
    if approval.revoked_at is not None:
        return f"revoked by {approval.revoked_by}"
    if approval.spent_at is not None:
        return f"granted by {approval.granted_by}, spent"
    if approval.granted_at is not None:
        return f"granted by {approval.granted_by}"
    return "pending"


@click.group("approvals")
def approvals_group() -> None:
    """List, grant and revoke the approvals runs wait for."""


@approvals_group.command("list")
@click.option("--run", "run_id", type=click.UUID, default=None, help="Only this run's.")
@click.option("--pending", is_flag=True, help="Only those still waiting for a person.")
@limit_option
@database_url_option
@json_option
@one_line_errors
def approvals_list(run_id: uuid.UUID | None, pending: bool, limit: int,
                   database_url: str | None, as_json: bool) -> None:
    """The latest approvals, newest first: run, scope, expiry and who decided."""
    with open_engine(database_url) as engine, engine.connect() as conn:
        found = list_approvals(conn, run_id=run_id, pending=pending, limit=limit)
    if as_json:
        echo_json([a.__dict__ for a in found])
        return
    echo_table(["approval", "run", "scope", "expires", "state", "reason"],
               [[a.id, a.run_id, compact_json(a.scope), a.expires_at, _state(a), a.reason]
                for a in found], empty="no approvals")


@approvals_group.command("grant")
@click.argument("approval_id", type=click.UUID)
@who_option("--by", who="who grants it", help="Who grants it; recorded on the approval.")
@click.option("--reason", default=None, help="Why; recorded on the approval (the audit shows it).")
@database_url_option
@one_line_errors
def approvals_grant(approval_id: uuid.UUID, by: str, reason: str | None,
                    database_url: str | None) -> None:
    """Grant an approval: its waiting run wakes and goes on."""
    with open_engine(database_url) as engine, engine.begin() as conn:
        approval = grant(conn, approval_id, by=by, reason=reason)
    click.echo(f"approval {approval.id} granted by {approval.granted_by}; "
               f"run {approval.run_id} wakes")


@approvals_group.command("revoke")
@click.argument("approval_id", type=click.UUID)
@click.option("--reason", required=True, help="Why; recorded, and shown to whoever resumes it.")
@who_option("--by", who="who revokes it", help="Who revokes it; recorded on the approval.")
@database_url_option
@one_line_errors
def approvals_revoke(approval_id: uuid.UUID, reason: str, by: str,
                     database_url: str | None) -> None:
    """Revoke an approval (granted or not): the run that resumes on it goes to needs-human."""
    with open_engine(database_url) as engine, engine.begin() as conn:
        approval = revoke(conn, approval_id, by=by, reason=reason)
    click.echo(f"approval {approval.id} revoked by {by}: {reason}")


@approvals_group.command("audit")
@click.option("--run", "run_id", type=click.UUID, default=None, help="Only this run's.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
              help="Show at most this many approvals.")
@database_url_option
@json_option
@one_line_errors
def approvals_audit_command(run_id: uuid.UUID | None, limit: int, database_url: str | None,
                            as_json: bool) -> None:
    """Who approved which exact call, why, and the message it was spent on, newest first
    (only approvals bound to a call: those with a digest)."""
    with open_engine(database_url) as engine, engine.connect() as conn:
        found = approvals_audit(conn, run_id=run_id, limit=limit)
    if as_json:
        echo_json([a.__dict__ for a in found])
        return
    echo_table(
        ["approval", "run", "call", "granted", "why", "revoked", "spent on"],
        [[a.approval_id, a.run_id, _call(a),
          f"{a.granted_by} {cell(a.granted_at)}" if a.granted_at else "-",
          a.grant_reason, f"{a.revoked_by} {cell(a.revoked_at)}" if a.revoked_at else "-",
          _spent_on(a)] for a in found],
        empty="no approval bound to a call")


def _call(audit: ApprovalAudit) -> str:
    # Keys sorted, as the digest has them (jsonb keeps its own order).
    args = json.dumps(audit.args, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)
    return f"{audit.tool}{args}"


def _spent_on(audit: ApprovalAudit) -> str:
    if audit.spent_at is None:
        return "-"
    message = f"message {audit.spent_message_id} at {cell(audit.spent_at)}"
    if audit.topic is None:  # the relay's retention dropped the row
        return message
    return f"{message} ({audit.topic}, key {audit.key if audit.key is not None else '-'})"
