"""``outbox ops``: the operations ledger for a human — list what needs attention, resolve it.

Registered in the ``outboxkit.commands`` entry-point group. A resolution records who
(``--actor``, default ``$USER``) and why (``--reason``) in the operation and its events.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import click

from dedup.operations import Operation
from dedup.outcomes import Evidence
from dedup.resolution import list_operations, resolve_confirmed, resolve_not_applied
from outbox.cli import database_url_option, echo_json, echo_table, one_line_errors, open_engine
from outbox.tables import OPERATION_STATUSES


@click.group("ops")
def ops_group() -> None:
    """Operations on outside systems: list them, resolve the ones that need a human."""


@ops_group.command("list")
@database_url_option
@click.option("--status", "statuses", multiple=True, type=click.Choice(OPERATION_STATUSES),
              help="Only operations with this status (repeat for several). Default: all.")
@click.option("--system", help="Only operations on this outside system.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the operations as JSON.")
@one_line_errors
def ops_list(database_url: str | None, statuses: tuple[str, ...], system: str | None,
             limit: int, as_json: bool) -> None:
    """Operations, oldest first."""
    with open_engine(database_url) as engine, engine.connect() as conn:
        found = list_operations(conn, status=list(statuses) or None, system=system, limit=limit)
    if as_json:
        echo_json([_as_dict(op) for op in found])
        return
    echo_table(
        ["id", "system", "operation", "status", "calls", "checks", "reference", "run",
         "updated", "resolved by"],
        [[op.id, op.system, op.operation, op.status.value, op.calls, op.checks, op.reference,
          op.run_id, op.updated_at, op.resolved_by] for op in found],
        empty="no operations",
    )


@ops_group.command("resolve")
@click.argument("op_id", type=click.UUID)
@click.option("--confirmed", "outcome", flag_value="confirmed",
              help="It was applied: say so with --evidence (the outside system's reference).")
@click.option("--not-applied", "outcome", flag_value="not-applied",
              help="It was not applied: the reconciler calls again with the same key.")
@click.option("--evidence", help='What you found, as a JSON object: {"reference": "PO-1", ...}.')
@click.option("--reason", help="Why (required with --not-applied).")
@click.option("--actor", default=lambda: os.environ.get("USER", ""), show_default="$USER",
              help="Who resolves it (recorded with the resolution).")
@database_url_option
@one_line_errors
def ops_resolve(*, op_id: uuid.UUID, outcome: str | None, evidence: str | None,
                reason: str | None, actor: str, database_url: str | None) -> None:
    """Settle an operation by hand: --confirmed --evidence JSON, or --not-applied --reason."""
    if outcome is None:
        raise click.UsageError(
            "pass --confirmed (with --evidence) or --not-applied (with --reason)")
    if not actor:
        raise click.UsageError("say who resolves it: --actor (no $USER to default to)")
    found = _evidence(evidence)
    with open_engine(database_url) as engine, engine.begin() as conn:
        if outcome == "confirmed":
            if found is None:
                raise click.UsageError("--confirmed needs --evidence (a JSON object)")
            resolved = resolve_confirmed(conn, op_id, evidence=found, actor=actor,
                                         reason=reason or "confirmed with the evidence given")
        else:
            if not reason:
                raise click.UsageError("--not-applied needs --reason (why you know)")
            resolved = resolve_not_applied(conn, op_id, actor=actor, reason=reason,
                                           evidence=found)
    click.echo(f"operation {resolved.id} is {resolved.status.value} "
               f"(by {actor}: {resolved.resolution_reason})")
    if resolved.run_id is not None:
        click.echo(f"its run {resolved.run_id} is not moved: requeue it when ready "
                   "(outbox.runs.move(conn, run_id, 'queued', actor=..., reason=...))")


def _evidence(raw: str | None) -> Evidence | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--evidence") from exc
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--evidence")
    reference, digest = value.pop("reference", None), value.pop("response_digest", None)
    return Evidence(reference=None if reference is None else str(reference),
                    response_digest=None if digest is None else str(digest), detail=value)


def _as_dict(op: Operation) -> dict[str, Any]:
    return {**op.__dict__, "status": op.status.value}
