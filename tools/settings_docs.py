"""The configuration reference (docs/configuration.md), rendered from the settings classes.

The classes are the single source: a setting added, renamed or re-described shows up in the
reference when it is regenerated, and a test fails while the committed file is stale. The
relay's and consumer's classes are passed in, since this package never imports theirs;
``scripts/gen_config_docs.py`` does, and writes the file.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from outbox.settings import ConnectionSettings, OutboxSettings

REGENERATE = ".venv/bin/python scripts/gen_config_docs.py"


def env_var(cls: type[BaseSettings], name: str) -> str:
    return f"{cls.model_config.get('env_prefix', '')}{name}".upper()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: choices are listed, secrets said to be secret."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " (optional)"
    if origin in (frozenset, set, list):
        return f"JSON list of {type_name(args[0])}"
    if annotation is SecretStr:
        return "secret text"
    if annotation is str:
        return "text"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "computed"
    value = field.default
    if isinstance(value, SecretStr):
        if value.get_secret_value():
            return "hidden"  # a reference is read by everyone
        value = ""
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, frozenset | set | list | tuple):
        return f"`{list(value)}`"
    return f"`{value}`"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def settings_table(
    classes: Sequence[type[BaseSettings]],
    fields: Sequence[str] | None = None,
    *,
    flags: bool = True,
) -> str:
    """A Markdown table of *fields* (default: all) of the first of *classes*, naming the
    environment variable each of *classes* reads it from, and its command-line flag when
    the daemons take one (``outbox.cli.flags.settings_options``)."""
    first = classes[0]
    names = list(fields if fields is not None else first.model_fields)
    header = ["environment variable", *(["flag"] if flags else []), "type", "default",
              "what it does"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        field = first.model_fields[name]
        cells = ["<br>".join(f"`{env_var(cls, name)}`" for cls in classes)]
        if flags:
            pair = f" / `--no-{flag(name)[2:]}`" if field.annotation is bool else ""
            cells.append(f"`{flag(name)}`{pair}")
        cells += [type_name(field.annotation), default_text(field),
                  cell(field.description or "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def own_fields(cls: type[BaseSettings]) -> list[str]:
    """The fields *cls* adds to :class:`ConnectionSettings`."""
    return [n for n in cls.model_fields if n not in ConnectionSettings.model_fields]


INTRO = f"""\
# Configuration reference

<!-- Generated from the settings classes by `{REGENERATE}`; do not edit by hand. -->

Every setting is an environment variable. The relay (`outbox relay`, `python -m relay`) and
consumers (`outbox consume`, `python -m consumers`) also take each of their settings as a
flag, which wins over the environment. A bad value is reported as one line naming the
variable and the flag, and the daemon exits with status 2. Booleans read `true`/`false`
(also `1`/`0`, `yes`/`no`). Secret settings are never printed: not in logs, not in the
error for a bad value (shown as `<hidden>`), not in the settings' repr.
"""

SHARED = """
## Shared settings (`OUTBOXKIT_*`)

Read by the application's writes (`app.emit`, runs), the relay, consumers and the `outbox`
commands, from the environment only. Give every process of one system the same values.

In code, settings are bound once: on the `App` (`App(settings=OutboxSettings(...))`; default:
the environment, read once per process), whose operations and workers use them, and on the
handle a claim returns (`app.claim`, or the worker's), which passes them to every write. Pass
`App(settings=OutboxSettings(schema_name="tenant_a"))` for another schema; no operation takes
settings of its own.

"""

CONNECTION = """
## Connections: PostgreSQL and Kafka (relay and consumer)

The same settings in both daemons, each under its own prefix. TLS and SASL apply to every
Kafka client the daemon makes (producer, consumer, admin); see docs/operations.md,
"Kafka TLS and SASL", for an example.

"""

RELAY = """
## Relay (`OUTBOXKIT_RELAY_*`)

"""

CONSUMER = """
## Consumer (`OUTBOXKIT_CONSUMER_*`)

"""


def configuration_reference(
    relay: type[ConnectionSettings], consumer: type[ConnectionSettings]
) -> str:
    """The whole of docs/configuration.md, for the relay's and consumer's settings classes."""
    return "".join([
        INTRO,
        SHARED,
        settings_table([OutboxSettings], flags=False),
        CONNECTION,
        settings_table([relay, consumer], list(ConnectionSettings.model_fields)),
        RELAY,
        settings_table([relay], own_fields(relay)),
        CONSUMER,
        settings_table([consumer], own_fields(consumer)),
    ])
