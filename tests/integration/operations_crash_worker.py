"""A worker that places an order and is SIGKILLed right after sending it, before the outcome
is recorded; driven by tests/integration/test_operations_crash.py.

Usage: operations_crash_worker.py DATABASE_URL SUPPLIER_URL MESSAGE_ID
"""

from __future__ import annotations

import os
import signal
import sys

from sqlalchemy import create_engine

from dedup.ledger import CallOutcome, Ledger, Operation, System
from dedup.ledger.policy import ReconcilePolicy
from examples.supplier_client import SupplierClient
from outbox.db.dsn import sqlalchemy_url

LEDGER = Ledger()


def main() -> None:
    url, supplier_url, message_id = sys.argv[1:4]
    client = SupplierClient(supplier_url, timeout=5.0)

    def send_then_die(operation: Operation) -> CallOutcome:
        outcome = client.place_order(operation)  # the supplier has the order now
        sys.stdout.write(f"sent {operation.idempotency_key}: {type(outcome).__name__}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # before perform records the outcome
        return outcome  # not reached

    engine = create_engine(sqlalchemy_url(url))
    LEDGER.perform(engine, system=System("supplier", call=send_then_die,
                                  status_query=client.order_status),
                   operation="place-order", request={"item": "widget", "qty": 3},
                   message_id=message_id, policy=ReconcilePolicy(in_flight_grace=0.5))
    sys.stdout.write("outcome recorded: the crash did not happen\n")


if __name__ == "__main__":
    main()
