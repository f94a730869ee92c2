"""``outbox worker module:app``: run the workflows an :class:`outbox.App` registered.

Settings come from ``OUTBOXKIT_WORKER_*`` environment variables (docs/configuration.md); each
has its flag too (:func:`outbox.cli.flags.settings_options`). SIGTERM/SIGINT stop it
gracefully (:func:`outbox.cli.daemon.run_daemon`): no new claims, in-flight steps finish
within ``OUTBOXKIT_WORKER_SHUTDOWN_TIMEOUT_SECONDS``.
"""

from __future__ import annotations

import os
import sys

import click

from outbox.app import App
from outbox.cli.apps import import_app
from outbox.cli.daemon import run_daemon
from outbox.cli.flags import settings_options
from outbox.worker import Worker, WorkerSettings


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

    code = run_daemon(prog, build, settings)
    if built and built[0].abandoned:
        # A sync step abandoned at shutdown still runs in its thread, which exit would wait
        # for: leave now; its transaction rolls back with the connection.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
