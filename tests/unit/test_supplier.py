"""The local supplier used by the tests and the demo keeps its promises (a real HTTP server
in a thread), and the example client maps its answers to the ledger's outcomes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from dedup.ledger import Applied, Found, NotFound, Operation, OperationStatus, Refused, Unclear
from examples.supplier import Supplier, start_supplier
from examples.supplier_client import SupplierClient


def _op(key: str, request: object = None) -> Operation:
    now = datetime.now(UTC)
    return Operation(
        id=uuid.uuid4(), idempotency_key=key, system="supplier", operation="place-order",
        message_id=None, run_id=None, request_digest="sha256:x",
        request=request if request is not None else {"item": "widget", "qty": 3},
        status=OperationStatus.PENDING, calls=1, checks=0, version=1, reference=None,
        response_digest=None, evidence=None, last_error=None, next_check_at=None,
        resolved_by=None, resolution_reason=None, created_at=now, updated_at=now,
        resolved_at=None,
    )


@pytest.fixture
def client() -> Iterator[SupplierClient]:
    supplier: Supplier = start_supplier()
    try:
        yield SupplierClient(supplier.url, timeout=0.5)
    finally:
        supplier.stop()


def test_the_same_key_twice_returns_the_same_order_never_a_second(
    client: SupplierClient,
) -> None:
    first, second = client.place_order(_op("k1")), client.place_order(_op("k1"))
    assert isinstance(first, Applied)
    assert isinstance(second, Applied)
    assert first.evidence.reference == second.evidence.reference
    assert len(client.all_orders()) == 1
    assert client.posts() == {"k1": 2}


def test_a_key_reused_for_another_body_is_refused(client: SupplierClient) -> None:
    client.place_order(_op("k1"))
    outcome = client.place_order(_op("k1", {"item": "widget", "qty": 30}))
    assert isinstance(outcome, Refused)
    assert outcome.evidence.detail["http_status"] == 409


def test_status_query_finds_or_definitely_does_not(client: SupplierClient) -> None:
    client.place_order(_op("k1"))
    assert isinstance(client.order_status(_op("k1")), Found)
    assert client.order_status(_op("k2")) == NotFound({"http_status": 404})


@pytest.mark.parametrize(("behaviour", "expected", "orders"), [
    ({"orders": {"mode": "refuse"}}, Refused, 0),
    ({"orders": {"mode": "down"}}, Unclear, 0),
    ({"orders": {"mode": "drop"}}, Unclear, 0),
    ({"orders": {"mode": "apply-then-drop"}}, Unclear, 1),
    ({"orders": {"mode": "apply-then-timeout", "delay": 1.0}}, Unclear, 1),
    ({"orders": {"mode": "slow", "delay": 0.2}}, Applied, 1),
])
def test_each_misbehaviour_reads_as_the_right_outcome(
    client: SupplierClient, behaviour: dict[str, dict[str, object]], expected: type,
    orders: int,
) -> None:
    client.control(**behaviour)
    assert isinstance(client.place_order(_op("k1")), expected)
    assert len(client.all_orders()) == orders


def test_a_behaviour_with_times_reverts_to_normal(client: SupplierClient) -> None:
    client.control(status={"mode": "down", "times": 2})
    assert [type(client.order_status(_op("k"))) for _ in range(3)] == [
        Unclear, Unclear, NotFound]
