"""What the command lines share: a flag per setting and one-line setting errors.

Used by ``python -m relay`` and ``python -m consumers`` (which run their daemon with
:func:`outbox.runtime.run_daemon`) and the ``outbox`` commands.
"""

from __future__ import annotations

import argparse

from pydantic import ValidationError
from pydantic_settings import BaseSettings

SECRET_FIELDS = frozenset({"database_url", "kafka_sasl_password"})


def add_setting_flags(parser: argparse.ArgumentParser, settings: type[BaseSettings],
                      env_prefix: str) -> None:
    """One flag per setting, named after it (``batch_size`` → ``--batch-size``); booleans
    get ``--x`` and ``--no-x``. Unset flags stay ``None`` so the environment applies."""
    for name, field in settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or name} (env {env_prefix}{name.upper()})"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=None,
                                help=help_text)
            parser.add_argument("--no-" + flag[2:], dest=name, action="store_false",
                                help=f"the opposite of {flag}")
        else:
            parser.add_argument(flag, dest=name, help=help_text)


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
            f"--{field.replace('_', '-')}): {error['msg']} (got {value!r})"
        )
    return "\n".join(lines)
