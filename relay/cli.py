"""``python -m relay`` (and ``outbox relay``): run the relay daemon until SIGTERM/SIGINT.

Settings come from ``OUTBOXKIT_RELAY_*`` environment variables; flags override them. A bad
value is reported as one line naming the setting, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

from pydantic import ValidationError

from outbox.dsn import redact
from outbox.errors import OutboxError
from outbox.settings import OutboxSettings
from relay.daemon import Relay
from relay.logs import configure
from relay.settings import RelaySettings

EXIT_CONFIG = 2

def parser() -> argparse.ArgumentParser:
    """One flag per setting, named after it (``batch_size`` → ``--batch-size``)."""
    p = argparse.ArgumentParser(prog="relay", description=__doc__.split("\n")[0])
    for name, field in RelaySettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or name} (env OUTBOXKIT_RELAY_{name.upper()})"
        if field.annotation is bool:
            p.add_argument(flag, dest=name, action="store_true", default=None, help=help_text)
            p.add_argument("--no-" + flag[2:], dest=name, action="store_false",
                           help=f"the opposite of {flag}")
        else:
            p.add_argument(flag, dest=name, help=help_text)
    return p


def explain(exc: ValidationError) -> str:
    """One line per bad setting, naming both the env variable and the flag."""
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        value = "<hidden>" if field == "database_url" else error.get("input")
        lines.append(
            f"invalid setting {field} (env OUTBOXKIT_RELAY_{field.upper()}, flag "
            f"--{field.replace('_', '-')}): {error['msg']} (got {value!r})"
        )
    return "\n".join(lines)


def load(argv: Sequence[str] | None) -> tuple[RelaySettings, OutboxSettings]:
    args = vars(parser().parse_args(argv))
    overrides = {k: v for k, v in args.items() if v is not None}
    return RelaySettings(**overrides), OutboxSettings()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings, outbox_settings = load(argv)
    except ValidationError as exc:
        print(f"relay: {explain(exc)}", file=sys.stderr)
        return EXIT_CONFIG
    configure(settings.log_format, settings.log_level)
    try:
        relay = Relay(settings, outbox_settings)
    except OutboxError as exc:
        print(f"relay: {redact(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG

    def on_signal(signum: int, _frame: object) -> None:
        relay.stop()
        # The bound on a graceful stop: past it, leave at once. Rows not yet marked are
        # published again by the next relay (same message ids, dropped by consumers).
        timer = threading.Timer(settings.shutdown_timeout_seconds, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return relay.run()


if __name__ == "__main__":
    raise SystemExit(main())
