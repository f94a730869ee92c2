"""``outbox``: one command line for outboxkit.

``outbox migrate`` lives here, with the helpers every command shares (``--database-url``,
one-line errors, tables, JSON). All other commands come through the ``outboxkit.commands``
entry-point group: the write side's operator commands (``outbox runs``, ``outbox messages``,
``outbox purge``) from :mod:`outbox.cli.operator`, ``outbox relay`` / ``outbox status`` from the
relay package, ``outbox dlq`` / ``outbox consume`` from consumers, ``outbox ops`` from dedup.
So this module never imports them: the layering stays ``outbox`` ← ``relay`` ← ``consumers``.

Exit codes scripts can rely on: 0 done, 1 the operation failed (e.g. cannot connect),
2 bad usage or configuration.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import wraps
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox.db.dsn import redact, sqlalchemy_url
from outbox.errors import ConfigurationError, OutboxError
from outbox.settings import OutboxSettings

if TYPE_CHECKING:
    from sqlalchemy import Engine

EXIT_FAILED, EXIT_USAGE = 1, 2
F = TypeVar("F", bound=Callable[..., Any])

database_url_option = click.option(
    "--database-url",
    envvar="OUTBOXKIT_DATABASE_URL",
    show_envvar=True,
    help="PostgreSQL URL of the database holding the outboxkit schema.",
)


def who_option(flag: str, *, who: str, help: str, required: bool = True) -> Callable[[F], F]:
    """*flag* (``--actor``, ``--by``, ``--sender``): who does it, recorded with what it does;
    ``$USER`` by default, and a usage error saying *who* when neither is given (``None``
    instead when not *required*)."""

    def given(ctx: click.Context, param: click.Parameter, value: str) -> str | None:
        if not value:
            if not required:
                return None
            raise click.UsageError(f"say {who}: {flag} (no $USER to default to)", ctx)
        return value

    return click.option(flag, default=lambda: os.environ.get("USER", ""), show_default="$USER",
                        callback=given, help=help)


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
        except Exception as exc:
            # SQLAlchemy's errors are told apart only once raised: importing it here would
            # cost `python -m relay`, which imports these helpers, a third of its start-up.
            from sqlalchemy.exc import OperationalError, ProgrammingError  # noqa: PLC0415

            if isinstance(exc, ProgrammingError) and getattr(
                    exc.orig, "sqlstate", None) in {"42P01", "3F000"}:
                click.echo("outbox: the outboxkit tables are missing from this database: "
                           "run `outbox migrate` first", err=True)
                sys.exit(EXIT_FAILED)
            if isinstance(exc, OperationalError):
                url = kwargs.get("database_url") or ""
                reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
                click.echo(f"outbox: cannot connect to {redact(url)}: {reason}", err=True)
                sys.exit(EXIT_FAILED)
            raise

    return wrapper  # type: ignore[return-value]


def require_url(database_url: str | None) -> str:
    if not database_url:
        raise ConfigurationError("no database: pass --database-url or set OUTBOXKIT_DATABASE_URL")
    return sqlalchemy_url(database_url)


@contextmanager
def open_engine(database_url: str | None,
                settings: OutboxSettings | None = None) -> Iterator[Engine]:
    """An engine on *database_url* with the configured schema mapped in; disposed after."""
    from outbox.db.engines import engine_for  # noqa: PLC0415 - see one_line_errors
    from outbox.db.schema import translate  # noqa: PLC0415

    engine = engine_for(require_url(database_url), execution_options={
        "schema_translate_map": translate(settings or OutboxSettings())})
    try:
        yield engine
    finally:
        engine.dispose()


def echo_json(value: Any) -> None:
    """*value* as indented JSON on stdout (datetimes, UUIDs, enums as strings)."""
    click.echo(json.dumps(value, indent=2, default=str))


def compact_json(value: Any) -> str:
    """*value* as one line of JSON, for table cells (``-`` for nothing)."""
    if value is None:
        return "-"
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def echo_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *,
               empty: str = "nothing found") -> None:
    """A plain aligned table on stdout (no colours, so it pipes and greps well)."""
    if not rows:
        click.echo(empty)
        return
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def cell(value: Any) -> str:
    """How one value reads in a table: times to the second, ``-`` for nothing."""
    if value is None:
        return "-"
    if hasattr(value, "isoformat") and hasattr(value, "hour"):
        return str(value.strftime("%Y-%m-%d %H:%M:%S%z"))
    return str(value)


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


@click.group("outbox", cls=PluginGroup)
@click.version_option(package_name="outboxkit")
def main() -> None:
    """outboxkit: crash-safe agent runs, the transactional outbox, and its Kafka relay."""


@main.command("migrate")
@database_url_option
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
@one_line_errors
def migrate_command(database_url: str | None, dry_run: bool) -> None:
    """Create or upgrade the outboxkit tables (safe to run twice)."""
    from outbox.db.engines import engine_for  # noqa: PLC0415 - see one_line_errors
    from outbox.db.migrate import migrate, pending_sql  # noqa: PLC0415

    engine = engine_for(require_url(database_url))
    settings = OutboxSettings()
    try:
        if dry_run:
            click.echo(pending_sql(engine, settings=settings), nl=False)
            return
        applied = migrate(engine, settings=settings)
        click.echo(f"applied migrations {applied}" if applied else "schema is up to date")
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
