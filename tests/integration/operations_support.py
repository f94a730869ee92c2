"""Shared helpers for the operations-ledger tests: a fast policy, a waiting run, events."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine

from dedup.ledger import Ledger, Operation, OperationEvent, ReconcilePolicy
from examples.supplier import Supplier, start_supplier
from examples.supplier_client import SupplierClient
from outbox.handle import claim
from outbox.runs.lifecycle import get_run, start_run, transition

LEDGER = Ledger()


def fast_policy(**overrides: Any) -> ReconcilePolicy:
    """Checks due at once, short grace: tests do not wait for production-sized backoffs."""
    values: dict[str, Any] = {"initial_backoff": 0.0, "jitter": 0.0, "in_flight_grace": 0.3,
                              "claim_seconds": 10.0, "max_checks": 3, "max_calls": 3}
    values.update(overrides)
    return ReconcilePolicy(**values)


def supplier_and_client(timeout: float = 1.0) -> Iterator[tuple[Supplier, SupplierClient]]:
    supplier = start_supplier()
    try:
        yield supplier, SupplierClient(supplier.url, timeout=timeout)
    finally:
        supplier.stop()


def waiting_run(engine: Engine, key: str = "order-for-ticket-812") -> uuid.UUID:
    """A run that submitted its order and waits for the outcome (nobody holds its lease)."""
    with engine.begin() as conn:
        start_run(conn, workflow="supplier-order", workflow_version="1", idempotency_key=key)
    with engine.begin() as conn:
        job = claim(conn, worker="worker-1", lease_seconds=30)
        assert job is not None
        transition(conn, job.lease, "waiting", step="order-submitted",
                   evidence={"plan": "order 3 widgets"})
    return job.run.id


def run_state(engine: Engine, run_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return get_run(conn, run_id).state.value


def reload(engine: Engine, operation: Operation) -> Operation:
    with engine.connect() as conn:
        return LEDGER.get_operation(conn, operation.id)


def history(engine: Engine, operation: Operation) -> list[OperationEvent]:
    with engine.connect() as conn:
        return LEDGER.history(conn, operation.id)


def trail(engine: Engine, operation: Operation) -> list[tuple[str, str]]:
    """(kind, outcome) of every event, in order: the path the operation took."""
    return [(e.kind, e.outcome) for e in history(engine, operation)]
