"""``outbox``: one command line for outboxkit.

The write side's own commands live here (``outbox migrate``). Other packages add theirs
through the ``outboxkit.commands`` entry-point group (``outbox relay``, ``outbox status``
come from the relay package), so this module never imports them: the layering stays
``outbox`` ← ``relay`` ← ``consumers``.

Exit codes scripts can rely on: 0 done, 1 the operation failed (e.g. cannot connect),
2 bad usage or configuration.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from importlib.metadata import entry_points
from typing import Any, TypeVar

import click
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError, ProgrammingError

from outbox.dsn import redact, sqlalchemy_url
from outbox.errors import ConfigurationError, OutboxError
from outbox.migrate import migrate, pending_sql
from outbox.settings import OutboxSettings

EXIT_FAILED, EXIT_USAGE = 1, 2
F = TypeVar("F", bound=Callable[..., Any])

database_url_option = click.option(
    "--database-url",
    envvar="OUTBOXKIT_DATABASE_URL",
    show_envvar=True,
    help="PostgreSQL URL of the database holding the outboxkit schema.",
)


def one_line_errors(fn: F) -> F:
    """Turn outboxkit and connection errors into one line on stderr and an exit code."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigurationError as exc:
            click.echo(f"outbox: {exc}", err=True)
            sys.exit(EXIT_USAGE)
        except OutboxError as exc:
            click.echo(f"outbox: {exc}", err=True)
            sys.exit(EXIT_FAILED)
        except ProgrammingError as exc:
            if getattr(exc.orig, "sqlstate", None) not in {"42P01", "3F000"}:
                raise
            click.echo("outbox: the outboxkit tables are missing from this database: run "
                       "`outbox migrate` first", err=True)
            sys.exit(EXIT_FAILED)
        except OperationalError as exc:
            url = kwargs.get("database_url") or ""
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            click.echo(f"outbox: cannot connect to {redact(url)}: {reason}", err=True)
            sys.exit(EXIT_FAILED)

    return wrapper  # type: ignore[return-value]


def require_url(database_url: str | None) -> str:
    if not database_url:
        raise ConfigurationError("no database: pass --database-url or set OUTBOXKIT_DATABASE_URL")
    return sqlalchemy_url(database_url)


class PluginGroup(click.Group):
    """Adds the commands other outboxkit packages register as entry points."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *(e.name for e in _plugins())})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        for entry in _plugins():
            if entry.name == cmd_name:
                loaded: click.Command = entry.load()
                return loaded
        return None


def _plugins() -> list[Any]:
    return list(entry_points(group="outboxkit.commands"))


@click.group(cls=PluginGroup)
@click.version_option(package_name="outboxkit")
def main() -> None:
    """outboxkit: crash-safe agent runs, the transactional outbox, and its Kafka relay."""


@main.command("migrate")
@database_url_option
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
@one_line_errors
def migrate_command(database_url: str | None, dry_run: bool) -> None:
    """Create or upgrade the outboxkit tables (safe to run twice)."""
    engine = create_engine(require_url(database_url))
    settings = OutboxSettings()
    try:
        if dry_run:
            click.echo(pending_sql(engine, settings), nl=False)
            return
        applied = migrate(engine, settings=settings)
        click.echo(f"applied migrations {applied}" if applied else "schema is up to date")
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
