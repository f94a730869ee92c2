"""``outbox consume APP``: the consumers' command, registered in ``outboxkit.commands``."""

from __future__ import annotations

import sys

import click

from consumers import cli


@click.command(
    "consume",
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": [],
    },
    add_help_option=False,
)
@click.pass_context
def consume_command(ctx: click.Context) -> None:
    """Run an idempotent consumer app: outbox consume module:app [flags of python -m consumers]."""
    sys.exit(cli.main(ctx.args))
