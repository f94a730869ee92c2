"""``python -m relay``: the outbox relay daemon (the ``outbox relay`` command)."""

from relay.commands import relay_command

relay_command()
