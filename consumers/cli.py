"""``python -m consumers module:app`` (and ``outbox consume module:app``): run a consumer app.

Settings come from ``OUTBOXKIT_CONSUMER_*`` environment variables; flags override them. A
bad value is reported as one line naming the setting, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from consumers.app import Consumer
from consumers.runner import Runner
from consumers.settings import ConsumerSettings
from outbox.cli.daemon import EXIT_CONFIG, EXIT_FAILED, run_daemon
from outbox.cli.flags import add_setting_flags, explain
from outbox.errors import ConfigurationError

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "load_app", "main", "parser"]
# Help and errors name the command as typed; ``outbox consume`` passes its own.
PROG = "python -m consumers"


ENV_PREFIX = "OUTBOXKIT_CONSUMER_"


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The app path, then one flag per setting, named after it (``max_attempts`` →
    ``--max-attempts``)."""
    p = argparse.ArgumentParser(prog=prog, description="Run an idempotent consumer app.")
    p.add_argument("app", help="the Consumer object to run, as module:attribute")
    add_setting_flags(p, ConsumerSettings, ENV_PREFIX)
    return p


def load_app(path: str, settings: ConsumerSettings) -> Consumer:
    """Import ``module:attribute`` and give it *settings* (the CLI's, flags applied)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"app must be module:attribute, got {path!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like uvicorn: apps in the working directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    app = getattr(module, attribute, None)
    if not isinstance(app, Consumer):
        raise ConfigurationError(f"{path!r} is not a consumers.Consumer (got {type(app).__name__})")
    app.settings = settings
    app.group_id = settings.group_id or app.group_id
    return app


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """Run the app named in *argv*; *prog* is how the user called this (for help, errors)."""
    args = vars(parser(prog).parse_args(argv))
    path = args.pop("app")
    overrides = {k: v for k, v in args.items() if v is not None}
    try:
        settings = ConsumerSettings(**overrides)
    except ValidationError as exc:
        print(f"{prog}: {explain(exc, ENV_PREFIX)}", file=sys.stderr)
        return EXIT_CONFIG
    # Past the shutdown bound: whatever was committed in PostgreSQL but not in Kafka is
    # redelivered and dropped by the dedup marks.
    return run_daemon(prog, lambda: Runner(load_app(path, settings)), settings)
