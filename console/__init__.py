"""The operator console: a web page for the people in the loop (``outbox console``).

Runs, the outside calls whose outcome nobody knows, approvals, refused and dead-lettered
messages, the relays: read and acted on through the same library functions as the CLI.
Install it with ``pip install 'outboxkit[console]'``.
"""

from console.app import create_app
from console.settings import ConsoleSettings

__all__ = ["ConsoleSettings", "create_app"]
