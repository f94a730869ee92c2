"""Human resolution: list what needs attention, confirm with evidence or declare not applied,
always recording who and why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from dedup.ledger import Evidence, Ledger, Operation, OperationStatus, ResolutionRefused
from examples.supplier import Supplier
from examples.supplier_client import SupplierClient
from tests.integration.operations_support import (
    fast_policy,
    history,
    reload,
    supplier_and_client,
    trail,
)

LEDGER = Ledger()

ORDER = {"item": "widget", "qty": 3}


@pytest.fixture
def supplier() -> Iterator[tuple[Supplier, SupplierClient]]:
    yield from supplier_and_client(timeout=1.0)


def _needs_human(engine: Engine, client: SupplierClient, message_id: str,
                 orders_mode: str) -> Operation:
    client.control(orders={"mode": orders_mode, "delay": 2.0, "times": 1},
                   status={"mode": "down"})
    policy = fast_policy(max_checks=1)
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id=message_id, policy=policy)
    LEDGER.reconcile_due(engine, [client.system()], policy=policy)
    client.control(status={"mode": "normal"})
    escalated = reload(engine, op)
    assert escalated.status is OperationStatus.NEEDS_HUMAN
    return escalated


def test_a_human_confirms_with_evidence_and_the_ledger_records_who_and_why(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    op = _needs_human(engine, client, "m-1", "apply-then-timeout")
    with engine.connect() as conn:
        waiting = LEDGER.list_operations(conn, status="needs-human")
    assert [o.id for o in waiting] == [op.id]

    [order] = client.all_orders()
    with engine.begin() as conn:
        resolved = LEDGER.resolve_confirmed(
            conn, op.id,
            evidence=Evidence(reference=order["order_id"], detail={"seen_in": "supplier portal"}),
            actor="alice@ops", reason="order visible in the supplier portal")
    assert resolved.status is OperationStatus.CONFIRMED
    assert (resolved.resolved_by, resolved.resolution_reason) == (
        "alice@ops", "order visible in the supplier portal")
    assert resolved.reference == order["order_id"]
    assert resolved.resolved_at is not None
    last = history(engine, resolved)[-1]
    assert (last.kind, last.outcome, last.actor) == ("resolution", "confirmed", "alice@ops")
    assert last.detail["reason"] == "order visible in the supplier portal"
    with engine.connect() as conn:
        assert LEDGER.list_operations(conn, status="needs-human") == []
        settled = LEDGER.list_operations(conn, status=["confirmed", "rejected"])
        assert [o.id for o in settled] == [op.id]


def test_not_applied_is_called_again_with_the_same_key_by_the_reconciler(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    op = _needs_human(engine, client, "m-1", "drop")
    assert client.all_orders() == []
    with engine.begin() as conn:
        marked = LEDGER.resolve_not_applied(conn, op.id, actor="bob@ops",
                                            reason="supplier support: no order under this key")
    assert marked.status is OperationStatus.NOT_APPLIED

    LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())

    final = reload(engine, marked)
    assert final.status is OperationStatus.CONFIRMED
    assert final.calls == 2
    assert trail(engine, final)[-3:] == [
        ("resolution", "not-applied"), ("retry", "pending"), ("call", "confirmed")]
    [order] = client.all_orders()
    assert order["idempotency_key"] == final.idempotency_key


def test_resolving_is_refused_for_settled_operations_and_without_who_and_why(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    done = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                          message_id="m-1", policy=fast_policy())
    open_op = _needs_human(engine, client, "m-2", "drop")
    with engine.begin() as conn, pytest.raises(ResolutionRefused, match="already settled"):
        LEDGER.resolve_not_applied(conn, done.id, actor="carol", reason="mistake")
    with engine.begin() as conn, pytest.raises(ResolutionRefused, match="who"):
        LEDGER.resolve_not_applied(conn, open_op.id, actor="", reason="")
    with engine.begin() as conn, pytest.raises(ResolutionRefused, match="evidence"):
        LEDGER.resolve_confirmed(conn, open_op.id, evidence=Evidence(),
                                 actor="carol", reason="looks fine")
    assert reload(engine, done).status is OperationStatus.CONFIRMED
    assert reload(engine, open_op).status is OperationStatus.NEEDS_HUMAN
