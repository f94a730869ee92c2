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
from typing import Any

from pydantic import ValidationError

from outbox.dsn import redact
from outbox.errors import OutboxError
from outbox.settings import OutboxSettings
from relay.daemon import Relay
from relay.logs import configure
from relay.settings import RelaySettings

EXIT_CONFIG = 2

FLAGS: dict[str, dict[str, Any]] = {
    "database_url": {"help": "PostgreSQL URL (env OUTBOXKIT_RELAY_DATABASE_URL)"},
    "kafka_bootstrap": {"help": "Kafka bootstrap servers host:port[,host:port]"},
    "relay_id": {"help": "name of this relay instance"},
    "batch_size": {"help": "rows claimed per batch"},
    "poll_interval_seconds": {"help": "fallback poll interval"},
    "lane_lease_seconds": {"help": "lane lease length"},
    "http_host": {"help": "address of /metrics, /healthz, /readyz"},
    "http_port": {"help": "port of /metrics, /healthz, /readyz (0: off)"},
    "on_permanent_failure": {"help": "dead-letter | block"},
    "compression": {"help": "none | gzip | lz4 | zstd | snappy"},
    "linger_ms": {"help": "producer linger.ms"},
    "published_retention_seconds": {"help": "delete published rows after this long (0: never)"},
    "shutdown_timeout_seconds": {"help": "bound on a graceful stop"},
    "log_format": {"help": "text | json"},
    "log_level": {"help": "DEBUG | INFO | WARNING | ERROR"},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relay", description=__doc__.split("\n")[0])
    for field, kwargs in FLAGS.items():
        p.add_argument("--" + field.replace("_", "-"), dest=field, **kwargs)
    p.add_argument(
        "--create-topics",
        dest="create_topics",
        action="store_true",
        default=None,
        help="create missing topics on first use",
    )
    p.add_argument(
        "--no-create-topics",
        dest="create_topics",
        action="store_false",
        help="fail rows for missing topics instead",
    )
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
