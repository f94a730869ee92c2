"""The relay's commands for the ``outbox`` command line: ``outbox relay`` (the daemon, also
``python -m relay``; ``outbox relay rebase``), ``outbox status``.

Registered in the ``outboxkit.commands`` entry-point group, so ``outbox`` (in the base
package) never imports the relay.
"""

from __future__ import annotations

import json
import sys

import click

from outbox.cli.daemon import run_daemon
from outbox.cli.flags import load_settings, settings_options
from outbox.cli.main import EXIT_USAGE, database_url_option, one_line_errors, require_url
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings
from relay.daemon import Relay
from relay.history import REBASE_HINT
from relay.rebase import check_history, rebase
from relay.settings import RelaySettings
from relay.status import read_status


@click.group("relay", invoke_without_command=True, subcommand_metavar="[rebase]",
             context_settings={"help_option_names": ["-h", "--help"]})
@settings_options(RelaySettings, prog="relay")
def relay_command(settings: RelaySettings) -> None:
    """Run the relay daemon until SIGTERM/SIGINT (also `python -m relay`); `outbox relay
    rebase` after moving the database to another cluster.

    Settings come from OUTBOXKIT_RELAY_* environment variables; options override them. A bad
    value is reported as one line naming the setting, and the command exits with status 2.
    """
    outbox_settings = load_settings(OutboxSettings, "relay")
    # Past the shutdown bound, rows not yet marked are published again by the next relay
    # (same message ids, dropped by consumers).
    sys.exit(run_daemon("relay", lambda: Relay(settings, outbox_settings), settings))


@relay_command.command("rebase")
@database_url_option
@click.option("--yes", is_flag=True, help="Do it without asking.")
@click.option("--force", is_flag=True,
              help="Rebase although the outbox's ids look like this server's (every row not "
                   "purged yet is then sent again).")
@one_line_errors
def rebase_command(database_url: str | None, yes: bool, force: bool) -> None:
    """Make a restored or moved outbox this cluster's: published rows stay published,
    pending ones are sent once by the next relays. Stop every relay first."""
    from outbox.db.engines import engine_for  # noqa: PLC0415 - the daemon runs without it

    schema = OutboxSettings().schema_name
    engine = engine_for(require_url(database_url))
    try:
        with engine.begin() as conn:
            history = check_history(conn, schema)
            if not history.moved and not force:
                raise ConfigurationError(
                    "the outbox's transaction ids are this server's: nothing to rebase (with "
                    "--force, every row not purged yet would be sent again)")
            if history.moved:
                click.echo(history.describe())
            if not yes and not click.confirm("rebase the outbox now?", default=False):
                raise click.Abort
            done = rebase(conn, schema)
    finally:
        engine.dispose()
    click.echo(f"rebased: {done.seen} rows kept as published or refused, {done.pending} rows "
               "pending (the relays publish them once, in id order); start the relays")


@click.command("status")
@database_url_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option(
    "--lease-seconds",
    type=click.FloatRange(min=1.0),
    default=RelaySettings.model_fields["lane_lease_seconds"].default,
    envvar="OUTBOXKIT_RELAY_LANE_LEASE_SECONDS",
    show_envvar=True,
    show_default=True,
    help="The relays' lane lease: a relay whose heartbeat is older than this is shown dead.",
)
@one_line_errors
def status_command(database_url: str | None, as_json: bool, lease_seconds: float) -> None:
    """Backlog, oldest pending age, failed messages, and each relay with its lanes."""
    from outbox.db.engines import engine_for  # noqa: PLC0415 - the daemon runs without it

    engine = engine_for(require_url(database_url))
    try:
        with engine.connect() as conn:
            status = read_status(conn, OutboxSettings().schema_name, lease_seconds=lease_seconds)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps(status.as_dict(), indent=2, default=str))
        return
    click.echo(f"pending messages     {status.pending}")
    click.echo(f"oldest pending age   {status.oldest_pending_age_s:.1f} s")
    click.echo(f"failed messages      {status.failed}")
    click.echo(f"published (kept)     {status.published}")
    if not any(not relay.dead for relay in status.relays):
        click.echo("relays               none alive")
    for relay in status.relays:
        click.echo(f"relay {relay.relay_id:<24} {relay.state}, heartbeat "
                   f"{relay.heartbeat_age_s:.1f} s ago, {len(relay.lanes)} lanes "
                   f"{compact(relay.lanes)}".rstrip())
    if status.unowned_lanes:
        click.echo(f"lanes without owner  {compact(status.unowned_lanes)}")
    if status.history_moved:
        click.echo(f"history moved        {status.history_moved}: the database was restored "
                   f"or moved into another cluster; {REBASE_HINT}")


def compact(lanes: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5'."""
    runs: list[list[int]] = []
    for lane in sorted(lanes):
        if runs and runs[-1][1] == lane - 1:
            runs[-1][1] = lane
        else:
            runs.append([lane, lane])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


__all__ = ["EXIT_USAGE", "rebase_command", "relay_command", "status_command"]
