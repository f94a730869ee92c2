"""What the daemons' command lines share: a flag per setting, one-line setting errors, and
a bounded graceful stop on SIGTERM/SIGINT.

Used by ``python -m relay`` and ``python -m consumers``; the library itself never installs
signal handlers.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable

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


def stop_gracefully_on_signals(stop: Callable[[], None], bound_s: float) -> None:
    """SIGTERM/SIGINT call *stop*; if the process is still alive *bound_s* later, it exits
    at once with status 1. Whatever was not recorded by then is redone after a restart
    (duplicates carry the same message ids), so leaving early loses nothing."""

    def on_signal(signum: int, _frame: object) -> None:
        stop()
        timer = threading.Timer(bound_s, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
