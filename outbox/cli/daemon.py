"""How ``outbox relay`` and ``outbox consume`` run their daemon: the same steps, exit codes
and one-line errors for both.

Only command-line entry points call this: it configures logging and installs signal
handlers, which the library itself never does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from outbox.db.dsn import redact
from outbox.errors import ConfigurationError, OutboxError
from outbox.runtime.logs import configure_logging

EXIT_FAILED, EXIT_CONFIG = 1, 2


class Daemon(Protocol):
    def run(self) -> int: ...

    def stop(self) -> None: ...


class DaemonSettings(Protocol):
    @property
    def log_format(self) -> str: ...

    @property
    def log_level(self) -> str: ...

    @property
    def shutdown_timeout_seconds(self) -> float: ...


def run_daemon(prog: str, build: Callable[[], Daemon], settings: DaemonSettings, *,
               exit_margin_s: float = 0.0) -> int:
    """Log as *settings* say, build the daemon, stop it gracefully on SIGTERM/SIGINT (within
    ``shutdown_timeout_seconds``, plus *exit_margin_s* for a daemon that ends its own grace
    period itself and needs the time to say what it abandoned) and run it until then.

    An error that says what to fix is printed as one line after *prog*: a configuration
    error exits with 2 (before or after connecting: the Kafka client's checks come late),
    any other of outboxkit's errors with 1.
    """
    configure_logging(settings.log_format, settings.log_level)
    try:
        daemon = build()
    except OutboxError as exc:
        print(f"{prog}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    stop_gracefully_on_signals(daemon.stop, settings.shutdown_timeout_seconds + exit_margin_s)
    try:
        return daemon.run()
    except OutboxError as exc:
        print(f"{prog}: {redact(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(exc, ConfigurationError) else EXIT_FAILED


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
