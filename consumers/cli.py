"""``python -m consumers module:app`` (and ``outbox consume module:app``): run a consumer app.

Settings come from ``OUTBOXKIT_CONSUMER_*`` environment variables; flags override them. A
bad value is reported as one line naming the setting, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Sequence

from pydantic import ValidationError

from consumers.app import Consumer
from consumers.runner import Runner
from consumers.settings import ConsumerSettings
from outbox.dsn import redact
from outbox.errors import ConfigurationError, OutboxError
from relay.logs import configure

EXIT_FAILED, EXIT_CONFIG = 1, 2
PROG = "consumers"


def parser() -> argparse.ArgumentParser:
    """The app path, then one flag per setting, named after it (``max_attempts`` →
    ``--max-attempts``)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("app", help="the Consumer object to run, as module:attribute")
    for name, field in ConsumerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(
            flag,
            dest=name,
            help=f"{field.description or name} (env OUTBOXKIT_CONSUMER_{name.upper()})",
        )
    return p


def explain(exc: ValidationError) -> str:
    """One line per bad setting, naming both the env variable and the flag."""
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        if not field:
            lines.append(f"invalid settings: {error['msg'].removeprefix('Value error, ')}")
            continue
        value = "<hidden>" if field == "database_url" else error.get("input")
        lines.append(
            f"invalid setting {field} (env OUTBOXKIT_CONSUMER_{field.upper()}, flag "
            f"--{field.replace('_', '-')}): {error['msg']} (got {value!r})"
        )
    return "\n".join(lines)


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


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    path = args.pop("app")
    overrides = {k: v for k, v in args.items() if v is not None}
    try:
        settings = ConsumerSettings(**overrides)
    except ValidationError as exc:
        print(f"{PROG}: {explain(exc)}", file=sys.stderr)
        return EXIT_CONFIG
    configure(settings.log_format, settings.log_level)
    try:
        app = load_app(path, settings)
        runner = Runner(app)
    except OutboxError as exc:
        print(f"{PROG}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG

    def on_signal(signum: int, _frame: object) -> None:
        runner.stop()
        # The bound on a graceful stop: past it, leave at once. Whatever was committed in
        # PostgreSQL but not in Kafka is redelivered and dropped by the dedup marks.
        timer = threading.Timer(settings.shutdown_timeout_seconds, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return runner.run()
    except ConfigurationError as exc:
        print(f"{PROG}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except OutboxError as exc:
        print(f"{PROG}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
