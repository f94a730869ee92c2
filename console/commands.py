"""``outbox console``: serve the console; ``outbox console hash-password``: a user's hash."""

from __future__ import annotations

import click
from pydantic import SecretStr

from outbox.cli.main import one_line_errors
from outbox.errors import ConfigurationError


@click.group("console", invoke_without_command=True)
@click.option("--database-url",
              help="PostgreSQL URL (default: $OUTBOXKIT_CONSOLE_DATABASE_URL, then "
                   "$OUTBOXKIT_DATABASE_URL: the console's own, least-privileged role first).")
@click.option("--host", help="Address to listen on (default 127.0.0.1: this machine only).")
@click.option("--port", type=click.IntRange(0, 65535), help="Port (default 8470).")
@click.pass_context
@one_line_errors
def console_command(ctx: click.Context, database_url: str | None, host: str | None,
                    port: int | None) -> None:
    """The operator console: a web page of runs, what needs a person, messages, relays."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        import uvicorn  # noqa: PLC0415 - the console's extra, imported only to serve

        from console.app import create_app  # noqa: PLC0415
        from console.settings import ConsoleSettings  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigurationError(f"the console needs its extra ({exc.name} is missing): "
                                 "pip install 'outboxkit[console]'") from exc
    given: dict[str, object] = {k: v for k, v in {"host": host, "port": port}.items()
                                if v is not None}
    settings = ConsoleSettings(**given)  # type: ignore[arg-type]
    if database_url:
        settings = settings.model_copy(update={"database_url": SecretStr(database_url)})
    app = create_app(settings)
    users = "" if app.state.console.users.any else (
        " (read-only: no OUTBOXKIT_CONSOLE_USERS; `outbox console hash-password` makes one)")
    shown = "127.0.0.1" if settings.host in ("0.0.0.0", "") else settings.host  # noqa: S104
    click.echo(f"outboxkit console on http://{shown}:{settings.port}/{users}")
    console = app.state.console

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # An open overview or run page is a stream that never ends by itself, and uvicorn
            # waits for every request: end the streams first (the pages reconnect to the
            # next one, a run's from its last event).
            console.end_streams()
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                          access_log=False, timeout_graceful_shutdown=10)).run()


@console_command.command("hash-password")
@click.option("--user", required=True, help="The user's name.")
@click.option("--role", type=click.Choice(["operator", "viewer"]), default="operator",
              show_default=True)
@click.password_option(help="The password (asked for when not given).")
@one_line_errors
def hash_password_command(user: str, role: str, password: str) -> None:
    """Print a user's entry for OUTBOXKIT_CONSOLE_USERS (its password hashed with scrypt)."""
    from console.auth import hash_password  # noqa: PLC0415

    if ":" in user or "," in user:
        raise click.BadParameter("a user's name has no ':' or ','", param_hint="--user")
    click.echo(f"{user}:{role}:{hash_password(password)}")
