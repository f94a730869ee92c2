"""``outbox worker module:app``: run the workflows an :class:`outbox.App` registered.

Settings come from ``OUTBOXKIT_WORKER_*`` environment variables (docs/configuration.md); each
has its flag too (:func:`outbox.cli.flags.settings_options`). SIGTERM/SIGINT stop it
gracefully (:func:`outbox.cli.daemon.run_daemon`): no new claims, in-flight steps finish
within ``OUTBOXKIT_WORKER_SHUTDOWN_TIMEOUT_SECONDS``; the worker then abandons the rest itself
(logged, exit status 1), and the process exits at once. The signal's own deadline comes
:data:`EXIT_MARGIN_S` later, only for a worker stuck past its grace period.
"""

from __future__ import annotations

import os
import sys

import click

from outbox.app import App
from outbox.cli.apps import import_app
from outbox.cli.daemon import run_daemon
from outbox.cli.flags import settings_options
from outbox.worker import WorkerSettings
from outbox.worker.worker import Worker

EXIT_MARGIN_S = 5.0
"""After the grace period, the time the worker has to abandon its steps and say so before the
signal handler's deadline ends the process anyway (with status 1)."""


@click.command("worker", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("app_path", metavar="MODULE:APP")
@settings_options(WorkerSettings)
def worker_command(app_path: str, settings: WorkerSettings) -> None:
    """Run the workflows of an outbox.App: outbox worker module:app."""
    prog = click.get_current_context().command_path
    built: list[Worker] = []

    def build() -> Worker:
        built.append(Worker(import_app(app_path, App, "an outbox.App"), settings))
        return built[0]

    code = run_daemon(prog, build, settings, exit_margin_s=EXIT_MARGIN_S)
    if built and built[0].abandoned:
        # A sync step abandoned at shutdown still runs in its thread (the pool's threads are
        # not daemons: exit would wait for it): leave now. Its transaction dies with the
        # connection, unless it was committing at this very moment (fenced: then once).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
