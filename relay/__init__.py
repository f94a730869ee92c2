"""outboxkit's relay: publishes committed outbox rows to Kafka, per key in order, at least once.

Run it with ``python -m relay`` (or ``outbox relay``); embed it with :class:`Relay`.
"""

from relay.daemon import Relay
from relay.settings import RelaySettings

__all__ = ["Relay", "RelaySettings"]
