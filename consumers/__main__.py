"""``python -m consumers module:app``: run an idempotent consumer app (``outbox consume``)."""

from consumers.commands import consume_command

consume_command()
