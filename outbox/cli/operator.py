"""The write side's operator commands: ``outbox runs``, ``outbox messages``, ``outbox purge``.

Registered in the ``outboxkit.commands`` entry-point group like every other package's
commands (so ``python -m outbox.cli.main`` and the ``outbox`` script find them the same way).
Each reads ``--database-url`` / ``OUTBOXKIT_DATABASE_URL``, prints data as a table or, with
``--json``, as JSON, and reports a failure as one line (exit 1; bad usage: exit 2).
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from datetime import timedelta
from typing import Any

import click

from outbox.cli.main import (
    compact_json,
    database_url_option,
    echo_json,
    echo_table,
    one_line_errors,
    open_engine,
    who_option,
)
from outbox.db.execution import run_plan
from outbox.db.tables import RUN_STATES
from outbox.messages.backlog import Listed, list_messages, retry_messages, run_messages
from outbox.runs import children, compensation
from outbox.runs.lifecycle import Run, RunView, history, list_runs, view_run
from outbox.runs.requeue import requeue
from outbox.runs.retention import DEFAULT_STATES, purge, purgeable
from outbox.runs.signals import send_plan
from outbox.settings import OutboxSettings

json_option = click.option("--json", "as_json", is_flag=True, help="Print the data as JSON.")
limit_option = click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
                            help="Show at most this many rows.")


UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def duration(_ctx: click.Context, _param: click.Parameter, value: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` → a ``timedelta`` (a click callback)."""
    match = re.fullmatch(r"\s*(\d+)\s*([smhdw])\s*", value)
    if match is None:
        raise click.BadParameter(f"{value!r} is not a duration like 30d, 12h, 90m, 45s or 2w")
    return timedelta(**{UNITS[match[2]]: int(match[1])})


def _run_dict(view: RunView) -> dict[str, Any]:
    run = view.run
    return {**run.__dict__, "state": run.state.value, "held": run.held,
            "lease_owner": view.lease_owner, "lease_expires_at": view.lease_expires_at,
            "checkpoint_bytes": view.checkpoint_bytes}


def _state(run: Run) -> str:
    """The run's state as a table shows it: a child its parent's bound holds back says so."""
    return f"{run.state.value} (held)" if run.held else run.state.value


def _lease(view: RunView) -> str:
    if view.lease_owner is None:
        return "-"
    until = view.lease_expires_at.strftime("%H:%M:%S") if view.lease_expires_at else "?"
    return f"{view.lease_owner} until {until}"


# --- outbox runs ----------------------------------------------------------------------------


@click.group("runs")
def runs_group() -> None:
    """Agent runs: list them, show one with the history behind its state, requeue one."""


@runs_group.command("list")
@database_url_option
@click.option("--state", type=click.Choice(RUN_STATES), help="Only runs in this state.")
@click.option("--workflow", help="Only runs of this workflow.")
@limit_option
@json_option
@one_line_errors
def runs_list(database_url: str | None, state: str | None, workflow: str | None, limit: int,
              as_json: bool) -> None:
    """Runs, most recently updated first."""
    with open_engine(database_url) as engine, engine.connect() as conn:
        views = list_runs(conn, state=state, workflow=workflow, limit=limit)
    if as_json:
        echo_json([_run_dict(v) for v in views])
        return
    echo_table(
        ["id", "workflow", "state", "step", "attempts", "lease", "updated"],
        [[v.run.id, f"{v.run.workflow}@{v.run.workflow_version}", _state(v.run),
          v.run.step, v.run.attempts, _lease(v), v.run.updated_at] for v in views],
        empty="no runs",
    )


@runs_group.command("show")
@click.argument("run_id", type=click.UUID)
@database_url_option
@json_option
@one_line_errors
def runs_show(run_id: uuid.UUID, database_url: str | None, as_json: bool) -> None:
    """One run: state, step, versions, lease, checkpoint size, evidence, and its history."""
    with open_engine(database_url) as engine, engine.connect() as conn:
        view = view_run(conn, run_id)
        moves = history(conn, run_id)
        sent = run_messages(conn, run_id)
        effects = run_plan(conn, compensation.effects_plan(run_id))
    if as_json:
        echo_json({**_run_dict(view), "checkpoint": None,
                   "history": [t.__dict__ for t in moves],
                   "messages": [m.as_dict() for m in sent],
                   "effects": [e.__dict__ for e in effects]})
        return
    run = view.run
    versions = f"workflow {run.workflow_version}, prompt {run.prompt_version or '-'}, " \
               f"tool schema {run.tool_schema_version or '-'}"
    size = "-" if view.checkpoint_bytes is None else f"{view.checkpoint_bytes} bytes"
    purged = f" (purged {run.purged_at:%Y-%m-%d})" if run.purged_at else ""
    for label, value in [
        ("run", f"{run.id}"), ("workflow", run.workflow), ("versions", versions),
        ("state", f"{_state(run)}{purged}" + (f" ({run.reason})" if run.reason else "")),
        ("step", run.step or "-"), ("attempts", str(run.attempts)),
        ("lease", _lease(view)), ("checkpoint", size),
        ("idempotency key", run.idempotency_key),
        ("last evidence", compact_json(run.last_evidence)),
    ]:
        click.echo(f"{label:<16} {value}")
    click.echo("")
    echo_table(
        ["#", "at", "from → to", "step", "reason", "actor", "evidence"],
        [[n, t.at, f"{t.from_state or '∅'} → {t.to_state}", t.step, t.reason, t.actor,
          compact_json(t.evidence)] for n, t in enumerate(moves, 1)],
        empty="no history",
    )
    click.echo("")
    echo_table(
        ["message", "topic", "key", "status", "partition", "offset", "published"],
        [[m.id, m.topic, m.key, m.status, _or_dash(m.kafka_partition), _or_dash(m.kafka_offset),
          m.published_at or "-"] for m in sent],
        empty="no outbox messages",
    )
    if effects:  # a run that emitted effects with their undo (docs/workflows.md)
        click.echo("")
        echo_table(
            ["effect", "message", "state", "undo message", "decided", "undo's evidence"],
            [[e.type, e.message_id, e.state, _or_dash(e.compensation_id),
              _or_dash(e.decided_at), compact_json(e.compensation_evidence)] for e in effects],
            empty="",
        )


def _or_dash(value: object) -> object:
    return "-" if value is None else value


@runs_group.command("requeue")
@click.argument("run_id", type=click.UUID)
@click.option("--reason", required=True,
              help="Why it can run again (e.g. the operation a person resolved); recorded.")
@who_option("--actor", who="who requeues it",
            help="Who requeues it; recorded in the run's history.")
@click.option("--force", is_flag=True,
              help="Requeue even though an operation of the run has no settled outcome.")
@database_url_option
@one_line_errors
def runs_requeue(run_id: uuid.UUID, reason: str, actor: str, force: bool,
                 database_url: str | None) -> None:
    """Put a failed or needs-human run back in the queue (attempts reset), e.g. once a person
    resolved what it waited on."""
    if not reason.strip():
        raise click.UsageError("--reason must say why the run can go again")
    with open_engine(database_url) as engine, engine.begin() as conn:
        before, _ = requeue(conn, run_id, reason=reason, actor=actor, force=force)
    click.echo(f"run {run_id}: {before.value} → queued (by {actor}: {reason})")


@runs_group.command("signal")
@click.argument("run_id", type=click.UUID)
@click.argument("name")
@click.option("--id", "signal_id", required=True,
              help="The signal's id: sending the same id again sends nothing.")
@click.option("--payload", default="null", show_default=True,
              help="The signal's payload, as JSON.")
@who_option("--sender", who="who sends it", help="Who sends it; kept with the signal.")
@database_url_option
@one_line_errors
def runs_signal(*, run_id: uuid.UUID, name: str, signal_id: str, payload: str, sender: str,
                database_url: str | None) -> None:
    """Send a run the named signal NAME (kept until it takes it; wakes it if it waits for
    NAME)."""
    try:
        value = json.loads(payload, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise click.BadParameter(f"not JSON ({exc})", param_hint="--payload") from exc
    with open_engine(database_url) as engine, engine.begin() as conn:
        sent = run_plan(conn, send_plan(run_id, name, value, signal_id=signal_id,
                                        sender=sender))
    click.echo(f"run {run_id}: signal {name!r} ({signal_id}) "
               + ("sent" if sent else "was already sent; nothing more"))


@runs_group.command("cancel")
@click.argument("run_id", type=click.UUID)
@click.option("--reason", default="cancelled", show_default=True,
              help="Why; recorded in the history of each run it moves.")
@who_option("--actor", who="who cancels it", help="Who cancels; recorded in the history.")
@database_url_option
@one_line_errors
def runs_cancel(*, run_id: uuid.UUID, reason: str, actor: str, database_url: str | None) -> None:
    """Fail a run and every unfinished run it started; a run with effects to undo
    compensates them first, the last first."""
    with open_engine(database_url) as engine, engine.begin() as conn:
        done = run_plan(conn, children.cancel_plan(run_id, actor=actor, reason=reason,
                                                   settings=None))
    for run in done.moved:
        then = "compensating its effects" if run.compensating_since else "failed"
        click.echo(f"run {run.id} ({run.workflow}): {then}")
    for held in done.held:
        click.echo(f"run {held}: a worker holds it; not moved (cancel it again after its step)")
    for undoing in done.compensating:
        click.echo(f"run {undoing}: compensating already; it ends failed once its effects "
                   "are undone")


@runs_group.command("keep-effect")
@click.argument("run_id", type=click.UUID)
@click.argument("message_id", type=click.UUID)
@click.option("--reason", required=True, help="Why the effect stays; kept with it.")
@who_option("--actor", who="who decides", help="Who decides; kept with the effect.")
@database_url_option
@one_line_errors
def runs_keep_effect(*, run_id: uuid.UUID, message_id: uuid.UUID, reason: str, actor: str,
                     database_url: str | None) -> None:
    """Let an effect of a compensating run (in needs-human) stay as it is, then requeue the
    run to go on undoing the ones before it."""
    with open_engine(database_url) as engine, engine.begin() as conn:
        effect = run_plan(conn, compensation.keep_plan(run_id, message_id, actor=actor,
                                                       reason=reason))
    click.echo(f"run {run_id}: {effect.type} ({message_id}) kept; requeue the run to go on "
               f"(outbox runs requeue {run_id} --reason ...)")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value PostgreSQL stores")


# --- outbox messages ------------------------------------------------------------------------


@click.group("messages")
def messages_group() -> None:
    """Outbox messages: list the backlog or the failures, retry failed ones."""


@messages_group.command("list")
@database_url_option
@click.option("--pending", "status", flag_value="pending", help="Messages waiting for the relay.")
@click.option("--failed", "status", flag_value="failed", help="Messages Kafka refused for good.")
@click.option("--published", "status", flag_value="published",
              help="Messages Kafka acknowledged, with their partition and offset.")
@click.option("--topic", help="Only messages of this topic.")
@limit_option
@json_option
@one_line_errors
def messages_list(database_url: str | None, status: str | None, topic: str | None, limit: int,
                  as_json: bool) -> None:
    """Pending, failed or published outbox messages, oldest first (payloads left out)."""
    if status not in ("pending", "failed", "published"):
        raise click.UsageError("pass --pending, --failed or --published")
    listed: Listed = "failed" if status == "failed" else \
        "published" if status == "published" else "pending"
    with open_engine(database_url) as engine, engine.connect() as conn:
        found = list_messages(conn, status=listed, topic=topic, limit=limit)
    if as_json:
        echo_json([m.as_dict() for m in found])
        return
    headers = ["id", "topic", "key", "type", "created"]
    rows: list[list[Any]] = [[m.id, m.topic, m.key, m.message_type, m.created_at]
                             for m in found]
    if status == "published":
        headers += ["partition", "offset", "published"]
        for row, m in zip(rows, found, strict=True):
            row += [m.kafka_partition, m.kafka_offset, m.published_at]
    if status == "failed":
        headers += ["blocking", "failed", "error"]
        for row, m in zip(rows, found, strict=True):
            error = (m.last_error or "-").splitlines()[0] if m.last_error else "-"
            row += ["yes" if m.blocking else "no", m.failed_at, error[:80]]
    echo_table(headers, rows, empty=f"no {status} messages")


@messages_group.command("retry")
@click.argument("ids", nargs=-1, type=click.IntRange(min=1))
@click.option("--all-failed", is_flag=True, help="Retry every failed message.")
@database_url_option
@one_line_errors
def messages_retry(ids: tuple[int, ...], all_failed: bool, database_url: str | None) -> None:
    """Publish failed messages again (and the ones of their key held back behind them)."""
    if bool(ids) == all_failed:
        raise click.UsageError("name the message ids to retry, or pass --all-failed (not both)")
    with open_engine(database_url) as engine, engine.begin() as conn:
        count = retry_messages(conn, None if all_failed else ids)
    click.echo(f"retried {count} message{'s' if count != 1 else ''}: the relay sends them again")


# --- outbox purge ---------------------------------------------------------------------------


@click.command("purge")
@database_url_option
@click.option("--older-than", default="30d", show_default=True, callback=duration,
              help="Purge runs finished longer ago than this (30d, 12h, 2w…).")
@click.option("--archive", is_flag=True,
              help="Keep a copy of each checkpoint and step results in run_archive.")
@click.option("--dry-run", is_flag=True,
              help="Print how many runs would be purged; change nothing.")
@click.option("--batch-size", type=click.IntRange(min=1), default=100, show_default=True,
              help="Runs per short transaction.")
@one_line_errors
def purge_command(database_url: str | None, older_than: timedelta, archive: bool, dry_run: bool,
                  batch_size: int) -> None:
    """Retention: drop checkpoints and step results of finished (done/failed) runs."""
    states = ", ".join(sorted(DEFAULT_STATES))
    with open_engine(database_url) as engine:
        with engine.connect() as conn:
            total = purgeable(conn, older_than=older_than)
        if dry_run:
            click.echo(f"would purge {total} runs ({states}) finished before "
                       f"now - {older_than}")
            return
        with click.progressbar(length=total, label="purging runs", file=sys.stderr) as bar:
            done = purge(engine, older_than=older_than, batch_size=batch_size, archive=archive,
                         settings=OutboxSettings(), on_batch=bar.update,
                         max_batches=total // batch_size + 2)
    kept = " (checkpoints archived in run_archive)" if archive else ""
    click.echo(f"purged {done} runs{kept}")
