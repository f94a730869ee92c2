"""``outbox ops``: the operations ledger for a human — list what needs attention, resolve it,
purge what is long settled.

Registered in the ``outboxkit.commands`` entry-point group. A resolution records who
(``--actor``, default ``$USER``) and why (``--reason``) in the operation and its events.
``ops purge`` lives here rather than next to ``outbox purge`` because ``outbox`` may not
import ``dedup``.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from datetime import timedelta
from typing import Any

import click

from dedup.ledger.ledger import Ledger
from dedup.ledger.operations import Operation
from dedup.ledger.outcomes import Evidence
from dedup.ledger.retention import (
    DEFAULT_BATCH,
    DEFAULT_DEDUP_WINDOW_SECONDS,
    PURGED_STATUSES,
    OperationsPurge,
    check_retention_window,
)
from outbox.cli.main import database_url_option, echo_json, echo_table, one_line_errors, open_engine
from outbox.cli.operator import duration
from outbox.db.tables import OPERATION_STATUSES
from outbox.settings import OutboxSettings


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
    """Operations, newest first, with why each stands where it does (reason, last error)."""
    wanted = list(statuses) or None
    with open_engine(database_url) as engine, engine.connect() as conn:
        ledger = Ledger()
        found = ledger.list_operations(conn, status=wanted, system=system, limit=limit)
        # Counted only when the limit may have cut the list: one more query, not every time.
        total = (ledger.count_operations(conn, status=wanted, system=system)
                 if len(found) == limit else len(found))
    cut = (f"showing the newest {len(found):,} of {total:,} operations; "
           "--limit N for more" if total > len(found) else None)
    if as_json:
        echo_json([_as_dict(op) for op in found])
        if cut:
            click.echo(cut, err=True)  # stdout stays valid JSON
        return
    echo_table(
        ["id", "system", "operation", "status", "calls", "checks", "reference", "run",
         "updated", "resolved by", "reason", "last error"],
        [[op.id, op.system, op.operation, op.status.value, op.calls, op.checks, op.reference,
          op.run_id, op.updated_at, op.resolved_by, _short(op.resolution_reason),
          _short(op.last_error)] for op in found],
        empty="no operations",
    )
    if cut:
        click.echo(cut)


SHORT_TEXT = 60
"""Characters of a reason or error shown in the table (``--json`` has them in full)."""


def _short(text: str | None) -> str | None:
    """*text* on one line, cut to :data:`SHORT_TEXT` characters: a 4 kB error page must not
    make the table unreadable."""
    if text is None:
        return None
    line = " ".join(text.split())
    return line if len(line) <= SHORT_TEXT else line[:SHORT_TEXT - 1] + "…"


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
    ledger = Ledger()
    with open_engine(database_url) as engine, engine.begin() as conn:
        if outcome == "confirmed":
            if found is None:
                raise click.UsageError("--confirmed needs --evidence (a JSON object)")
            reason = reason or "confirmed with the evidence given"
            resolved = ledger.resolve_confirmed(conn, op_id, evidence=found, actor=actor,
                                                reason=reason)
        else:
            if not reason:
                raise click.UsageError("--not-applied needs --reason (why you know)")
            resolved = ledger.resolve_not_applied(conn, op_id, actor=actor, reason=reason,
                                                  evidence=found)
        # The resolution's event says what happened to the run, in the same transaction.
        last = ledger.history(conn, resolved.id)[-1].detail if resolved.run_id else None
    click.echo(f"operation {resolved.id} is {resolved.status.value} "
               f"(by {actor}: {resolved.resolution_reason})")
    if isinstance(last, dict) and last.get("run"):
        click.echo(f"its {last['run']}")
    elif resolved.run_id is not None:
        click.echo(f"its run {resolved.run_id} is not moved: it is settled when the "
                   "operation is (the reconciler calls again with the same key)")


def _evidence(raw: str | None) -> Evidence | None:
    if raw is None:
        return None
    try:
        return Evidence.from_json(raw)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--evidence") from exc


def _as_dict(op: Operation) -> dict[str, Any]:
    return {**op.__dict__, "status": op.status.value}


# --- outbox ops purge -----------------------------------------------------------------------

DEDUP_RETENTION_ENV = "OUTBOXKIT_CONSUMER_DEDUP_RETENTION_SECONDS"


def _days_or_duration(ctx: click.Context, param: click.Parameter, value: str) -> timedelta:
    """``30`` (days) or a duration like ``30d``, ``12h``, ``2w`` (as ``outbox purge``)."""
    if re.fullmatch(r"\s*\d+\s*", value):
        return timedelta(days=int(value))
    return duration(ctx, param, value)


def _dedup_window(ctx: click.Context, param: click.Parameter,
                  value: str | None) -> timedelta:
    """The flag; else the consumers' own setting (seconds) from the environment; else its
    default. Read here, not from ConsumerSettings: dedup may not import consumers."""
    if value is not None:
        return _days_or_duration(ctx, param, value)
    raw = os.environ.get(DEDUP_RETENTION_ENV)
    if raw is None or not raw.strip():
        return timedelta(seconds=DEFAULT_DEDUP_WINDOW_SECONDS)
    try:
        return timedelta(seconds=float(raw))
    except ValueError as exc:
        raise click.BadParameter(f"{DEDUP_RETENTION_ENV}={raw!r} is not a number of seconds",
                                 param_hint="--dedup-window") from exc


@ops_group.command("purge")
@database_url_option
@click.option("--older-than", default="30d", show_default=True, callback=_days_or_duration,
              help="Purge operations settled longer ago than this: days (30) or a duration "
                   "(30d, 12h, 2w). At least the consumers' dedup window.")
@click.option("--dedup-window", callback=_dedup_window,
              help=f"The longest dedup window of the consumer groups that call perform "
                   f"(8d, 192h…). Default: ${DEDUP_RETENTION_ENV} (seconds), else the "
                   f"consumers' default, 8d. A shorter --older-than is refused.")
@click.option("--dry-run", is_flag=True,
              help="Print how many operations would be purged; change nothing.")
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH,
              show_default=True, help="Operations per short transaction.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@one_line_errors
def ops_purge(*, database_url: str | None, older_than: timedelta, dedup_window: timedelta,
              dry_run: bool, batch_size: int, as_json: bool) -> None:
    """Retention: delete settled (confirmed/rejected) operations and their events."""
    seconds, window = older_than.total_seconds(), dedup_window.total_seconds()
    statuses = ", ".join(PURGED_STATUSES)
    check_retention_window(seconds, window)  # before connecting: a usage error, exit 2
    settings = OutboxSettings()
    ledger = Ledger(settings=settings)
    with open_engine(database_url, settings) as engine:
        with engine.connect() as conn:
            would = ledger.count_purgeable(conn, seconds, dedup_window_seconds=window)
        if dry_run:
            done = would
        else:
            batches: list[OperationsPurge] = []
            with click.progressbar(length=would.operations, label="purging operations",
                                   file=sys.stderr) as bar:
                def progress(batch: OperationsPurge) -> None:
                    batches.append(batch)
                    bar.update(batch.operations)

                ledger.purge(engine, seconds, batch=batch_size, dedup_window_seconds=window,
                             on_batch=progress, max_batches=would.operations // batch_size + 2)
            done = OperationsPurge(sum(b.operations for b in batches),
                                   sum(b.events for b in batches))
    if as_json:
        echo_json({"dry_run": dry_run, "operations": done.operations, "events": done.events,
                   "statuses": list(PURGED_STATUSES), "older_than_seconds": seconds,
                   "dedup_window_seconds": window})
    elif dry_run:
        click.echo(f"would purge {done.operations} operations ({statuses}) and their "
                   f"{done.events} events, settled before now - {older_than}")
    else:
        click.echo(f"purged {done.operations} operations and their {done.events} events")
