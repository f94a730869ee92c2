"""What every process of the example agrees on: names, where the services are, how hard
the ledger tries. Read from the environment so each process is started the same way."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from functools import cache

from dedup.ledger import Operation, ReconcilePolicy
from examples.supplier_client import SupplierClient

WORKFLOW = "supplier-order"
WORKFLOW_VERSION = "1"
ACCOUNTS = 4  # message keys: the per-key order that Kafka must keep is per account
# The supplier client's timeout; "apply-then-timeout" answers later. A fault scenario that
# kills the consumer during a hanging call lengthens it (and the in-flight grace below).
CALL_TIMEOUT_S = float(os.environ.get("OUTBOXKIT_EXAMPLE_CALL_TIMEOUT", "1.5"))

# Short bounds so a demo or a fault scenario settles in seconds; a real deployment keeps
# the defaults (minutes to hours).
POLICY = ReconcilePolicy(
    max_checks=4,
    max_calls=3,
    initial_backoff=0.3,
    multiplier=2.0,
    max_backoff=2.0,
    # Longer than CALL_TIMEOUT_S: a live call is never second-guessed.
    in_flight_grace=float(os.environ.get("OUTBOXKIT_EXAMPLE_IN_FLIGHT_GRACE", "3.0")),
    claim_seconds=10.0,
    max_age_seconds=120.0,
)


def topic() -> str:
    return os.environ.get("OUTBOXKIT_EXAMPLE_TOPIC", "order.submit")


def group_id() -> str:
    return os.environ.get("OUTBOXKIT_EXAMPLE_GROUP", "supplier-orders")


def supplier_url() -> str:
    url = os.environ.get("OUTBOXKIT_EXAMPLE_SUPPLIER_URL")
    if not url:
        raise SystemExit("set OUTBOXKIT_EXAMPLE_SUPPLIER_URL to the supplier's base URL")
    return url


def database_url() -> str:
    url = os.environ.get("OUTBOXKIT_DATABASE_URL")
    if not url:
        raise SystemExit("set OUTBOXKIT_DATABASE_URL to the PostgreSQL URL")
    return url


def account_of(index: int, accounts: int = ACCOUNTS) -> str:
    return f"account-{index % accounts}"


@cache
def supplier() -> SupplierClient:
    """The supplier's client, as every process of the example calls it."""
    return SupplierClient(supplier_url(), timeout=CALL_TIMEOUT_S)


def retry_delay(op: Operation) -> float:
    """Come back when the ledger says the operation is next due (bounded to 0.2-2 s: the
    reconciler may settle it sooner)."""
    if op.next_check_at is None:
        return 1.0
    return min(2.0, max(0.2, (op.next_check_at - datetime.now(UTC)).total_seconds()))
