"""What the daemons' commands share: an option per setting and one-line setting errors.

``outbox relay`` (also ``python -m relay``), ``outbox consume`` (also ``python -m consumers``)
and ``outbox worker`` take their settings class's fields as options with
:func:`settings_options`, then run their daemon with :func:`outbox.cli.daemon.run_daemon`::

    @click.command("consume")
    @click.argument("app_path", metavar="MODULE:APP")
    @settings_options(ConsumerSettings)
    def consume_command(app_path: str, settings: ConsumerSettings) -> None: ...
"""

from __future__ import annotations

import functools
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import click
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from outbox.cli.daemon import EXIT_CONFIG

__all__ = ["SECRET_FIELDS", "env_prefix", "explain", "flag", "load_settings", "settings_options"]

SECRET_FIELDS = frozenset({"database_url", "kafka_sasl_password"})

F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound=BaseSettings)


def settings_options(settings_class: type[BaseSettings], *,
                     prog: str | None = None) -> Callable[[F], F]:
    """One option per field of *settings_class*, named after it (``batch_size`` →
    ``--batch-size``; booleans get ``--x/--no-x``); the command receives ``settings``, the
    class built from its environment variables with the options given on top.

    A value is checked by the settings class, not by click: a bad one (from an option or
    the environment) is one line per setting on stderr, naming both
    (:func:`explain`), after *prog* (default: the command as typed), and exit status 2.
    On a group, a subcommand runs instead of the group's body and takes none of these.
    """
    prefix = env_prefix(settings_class)
    names = tuple(settings_class.model_fields)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in names}
            overrides = {name: value for name, value in given.items() if value is not None}
            ctx = click.get_current_context()
            if ctx.invoked_subcommand is not None:
                if overrides:
                    raise click.UsageError(
                        f"{', '.join(flag(name) for name in overrides)}: options of "
                        f"`{ctx.command_path}` itself, not of `{ctx.invoked_subcommand}`")
                return None
            settings = load_settings(settings_class, prog or ctx.command_path, **overrides)
            return fn(*args, settings=settings, **kwargs)

        # Applied last field first, so that --help lists them in the class's order.
        for name in reversed(names):
            command = _option(name, settings_class.model_fields[name], prefix)(command)
        return command  # type: ignore[return-value]

    return decorate


def load_settings(settings_class: type[S], prog: str, **overrides: Any) -> S:
    """*settings_class* from its environment variables and *overrides*; if a value is bad,
    one line per setting on stderr after *prog*, and exit status 2."""
    try:
        return settings_class(**overrides)
    except ValidationError as exc:
        click.echo(f"{prog}: {explain(exc, env_prefix(settings_class))}", err=True)
        sys.exit(EXIT_CONFIG)


def explain(exc: ValidationError, env_prefix: str) -> str:
    """One line per bad setting, naming both the environment variable and the flag."""
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        if not field:  # a check across several settings
            lines.append(f"invalid settings: {error['msg'].removeprefix('Value error, ')}")
            continue
        value = "<hidden>" if field in SECRET_FIELDS else error.get("input")
        lines.append(
            f"invalid setting {field} (env {env_prefix}{field.upper()}, flag "
            f"{flag(field)}): {error['msg']} (got {value!r})"
        )
    return "\n".join(lines)


def env_prefix(settings_class: type[BaseSettings]) -> str:
    """What *settings_class*'s environment variables start with (``OUTBOXKIT_RELAY_``)."""
    return str(settings_class.model_config.get("env_prefix") or "")


def flag(name: str) -> str:
    """The option of setting *name*: ``batch_size`` → ``--batch-size``."""
    return "--" + name.replace("_", "-")


def _option(name: str, field: Any, prefix: str) -> Callable[[F], F]:
    # No default and no envvar on the click side: an option not given stays None, so the
    # settings class reads the environment (and its own default) as without a command line.
    help_text = f"{field.description or name} (env {prefix}{name.upper()})"
    if field.annotation is bool:
        return click.option(f"{flag(name)}/--no-{flag(name)[2:]}", name, default=None,
                            help=help_text)
    return click.option(flag(name), name, type=click.STRING, metavar=_metavar(field.annotation),
                        help=help_text)


def _metavar(annotation: Any) -> str:
    """``[a|b]`` for a choice, ``INTEGER`` / ``FLOAT`` for numbers, ``TEXT`` otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        return "[" + "|".join(str(value) for value in typing.get_args(annotation)) + "]"
    return {int: "INTEGER", float: "FLOAT"}.get(annotation, "TEXT")
