"""``python -m relay`` (and ``outbox relay``): run the relay daemon until SIGTERM/SIGINT.

Settings come from ``OUTBOXKIT_RELAY_*`` environment variables; flags override them. A bad
value is reported as one line naming the setting, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from outbox.cli.daemon import EXIT_CONFIG, run_daemon
from outbox.cli.flags import add_setting_flags, explain
from outbox.settings import OutboxSettings
from relay.daemon import Relay
from relay.settings import RelaySettings

__all__ = ["EXIT_CONFIG", "load", "main", "parser"]

ENV_PREFIX = "OUTBOXKIT_RELAY_"


def parser() -> argparse.ArgumentParser:
    """One flag per setting, named after it (``batch_size`` → ``--batch-size``)."""
    p = argparse.ArgumentParser(prog="relay", description=__doc__.split("\n")[0])
    add_setting_flags(p, RelaySettings, ENV_PREFIX)
    return p


def load(argv: Sequence[str] | None) -> tuple[RelaySettings, OutboxSettings]:
    args = vars(parser().parse_args(argv))
    overrides = {k: v for k, v in args.items() if v is not None}
    return RelaySettings(**overrides), OutboxSettings()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings, outbox_settings = load(argv)
    except ValidationError as exc:
        print(f"relay: {explain(exc, ENV_PREFIX)}", file=sys.stderr)
        return EXIT_CONFIG
    # Past the shutdown bound, rows not yet marked are published again by the next relay
    # (same message ids, dropped by consumers).
    return run_daemon("relay", lambda: Relay(settings, outbox_settings), settings)


if __name__ == "__main__":
    raise SystemExit(main())
