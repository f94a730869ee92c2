"""A checkout saga: reserve stock, charge the card, book the shipment, each at another
outside system over HTTP; if a step is refused, what took effect is undone, the last first,
each exactly once (docs/workflows.md, "Compensation").

* ``workflow.py``: the run (``outbox worker examples.saga.workflow:app``);
* ``consumer.py``: performs every effect and every undo through the operations ledger
  (``python -m consumers examples.saga.consumer:app``).

Every process reads the same environment: ``OUTBOXKIT_DATABASE_URL``,
``OUTBOXKIT_KAFKA_BOOTSTRAP``, ``OUTBOXKIT_EXAMPLE_TOPIC`` (the topics' prefix),
``OUTBOXKIT_EXAMPLE_GROUP`` and ``OUTBOXKIT_EXAMPLE_{STOCK,PAYMENTS,SHIPPING}_URL`` (the three
systems, each an ``examples/supplier.py``).
"""

from __future__ import annotations

import os

STEPS = [("stock", "reserve", "release"), ("payments", "charge", "refund"),
         ("shipping", "book", "cancel")]
"""(outside system, what it is asked, what undoes it), in the order a run asks them."""
SYSTEMS = [system for system, _, _ in STEPS]


def topic(system: str) -> str:
    """The topic of *system*'s effects and undos."""
    return f"{os.environ.get('OUTBOXKIT_EXAMPLE_TOPIC', 'checkout')}.{system}"


def system_url(system: str) -> str:
    name = f"OUTBOXKIT_EXAMPLE_{system.upper()}_URL"
    url = os.environ.get(name)
    if not url:
        raise SystemExit(f"set {name} to the {system} system's base URL")
    return url
