"""LEDGER.perform(): intent committed before the call, outcome after it, one call per key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, func, select, update

from dedup.ledger import Applied, Evidence, Ledger, OperationStatus, RequestMismatch
from examples.supplier import Supplier
from examples.supplier_client import SupplierClient
from outbox.db.tables import operation_events, operations
from tests.integration.operations_support import (
    fast_policy,
    reload,
    supplier_and_client,
    trail,
)

LEDGER = Ledger()

ORDER = {"item": "widget", "qty": 3}


@pytest.fixture
def supplier() -> Iterator[tuple[Supplier, SupplierClient]]:
    yield from supplier_and_client(timeout=1.0)


def test_slow_refusal_and_timeout_each_take_their_own_path(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    """The seeds' test: a slow answer is confirmed, a permanent failure rejected (never
    retried), a timeout left unknown and then settled by a status query, not a second call."""
    _, client = supplier
    system, policy = client.system(), fast_policy()

    client.control(orders={"mode": "slow", "delay": 0.3, "times": 1})
    slow = LEDGER.perform(engine, system=system, operation="place-order", request=ORDER,
                          message_id="m-slow", policy=policy)
    client.control(orders={"mode": "refuse", "times": 1})
    refused = LEDGER.perform(engine, system=system, operation="place-order", request=ORDER,
                             message_id="m-refused", policy=policy)
    client.control(orders={"mode": "apply-then-timeout", "delay": 2.0, "times": 1})
    timed_out = LEDGER.perform(engine, system=system, operation="place-order", request=ORDER,
                               message_id="m-timeout", policy=policy)

    assert slow.status is OperationStatus.CONFIRMED
    assert slow.reference is not None
    assert slow.reference.startswith("ORD-")
    assert slow.response_digest is not None
    assert slow.response_digest.startswith("sha256:")
    assert refused.status is OperationStatus.REJECTED
    assert refused.evidence["http_status"] == 422
    assert refused.reference is None
    assert timed_out.status is OperationStatus.UNKNOWN
    assert "timed out" in (timed_out.last_error or "")

    report = LEDGER.reconcile_due(engine, [system], policy=policy)
    assert report.claimed == 1
    assert report.statuses == {"confirmed": 1}

    assert trail(engine, slow) == [("intent", "pending"), ("call", "confirmed")]
    assert trail(engine, refused) == [("intent", "pending"), ("call", "rejected")]
    assert trail(engine, timed_out) == [
        ("intent", "pending"), ("call", "unknown"), ("check", "confirmed")]
    settled = reload(engine, timed_out)
    assert settled.status is OperationStatus.CONFIRMED
    assert settled.calls == 1
    assert settled.evidence["via"] == "status-query"
    # The supplier's own record: one order each for the slow and the timed-out call, none for
    # the refused one, and every key was POSTed exactly once.
    orders = {o["idempotency_key"]: o for o in client.all_orders()}
    assert set(orders) == {slow.idempotency_key, timed_out.idempotency_key}
    assert orders[timed_out.idempotency_key]["order_id"] == settled.reference
    assert client.posts() == {slow.idempotency_key: 1, refused.idempotency_key: 1,
                              timed_out.idempotency_key: 1}


def test_a_settled_operation_is_returned_on_redelivery_without_calling_again(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    first = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                           message_id="m-1", policy=fast_policy())
    again = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                           message_id="m-1", policy=fast_policy())
    assert first.status is OperationStatus.CONFIRMED
    assert again.id == first.id
    assert again.status is OperationStatus.CONFIRMED
    assert first.idempotency_key == LEDGER.idempotency_key("m-1", "place-order")
    assert client.posts() == {first.idempotency_key: 1}
    assert len(client.all_orders()) == 1


def test_same_key_with_a_different_request_is_a_clear_error_and_writes_nothing(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    first = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                           message_id="m-1", policy=fast_policy())

    def count(table: object) -> int:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]

    before = (count(operations), count(operation_events))
    with pytest.raises(RequestMismatch, match="reused for a different request") as caught:
        LEDGER.perform(engine, system=client.system(), operation="place-order",
                       request={"item": "widget", "qty": 30}, message_id="m-1",
                       policy=fast_policy())
    assert caught.value.key == first.idempotency_key
    assert caught.value.stored == first.request_digest
    assert (count(operations), count(operation_events)) == before
    assert client.posts() == {first.idempotency_key: 1}  # the second request was never sent


def test_key_order_of_the_request_does_not_change_its_digest(engine: Engine) -> None:
    with engine.begin() as conn:
        one = LEDGER.begin(conn, key="k-1", system="supplier", operation="place-order",
                           request={"item": "widget", "qty": 3})
    with engine.begin() as conn:
        two = LEDGER.begin(conn, key="k-1", system="supplier", operation="place-order",
                           request={"qty": 3, "item": "widget"})
    assert one.created
    assert not two.created
    assert two.operation.id == one.operation.id


def test_an_intent_found_pending_on_redelivery_is_checked_not_sent_again(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    """A delivery recorded the intent and sent the order, then died: the redelivery asks
    the supplier, finds the order and confirms it — the order is not placed twice."""
    _, client = supplier
    policy = fast_policy(in_flight_grace=0.0)
    key = LEDGER.idempotency_key("m-crashed", "place-order")
    with engine.begin() as conn:
        intent = LEDGER.begin(conn, key=key, system="supplier", operation="place-order",
                              request=ORDER, message_id="m-crashed", in_flight_grace=0.0)
    assert client.place_order(intent.operation).__class__.__name__ == "Applied"  # then "died"

    redelivered = LEDGER.perform(engine, system=client.system(), operation="place-order",
                                 request=ORDER, message_id="m-crashed", policy=policy)
    assert redelivered.status is OperationStatus.CONFIRMED
    assert trail(engine, redelivered) == [("intent", "pending"), ("check", "confirmed")]
    assert client.posts() == {key: 1}


def test_a_pending_intent_still_in_its_grace_period_is_left_to_its_caller(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    """Within in_flight_grace the call may still be in flight in a live process: a second
    delivery neither calls nor checks; it reports pending."""
    _, client = supplier
    with engine.begin() as conn:
        LEDGER.begin(conn, key=LEDGER.idempotency_key("m-2", "place-order"), system="supplier",
                     operation="place-order", request=ORDER, in_flight_grace=60.0)
    second = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                            message_id="m-2", policy=fast_policy(in_flight_grace=60.0))
    assert second.status is OperationStatus.PENDING
    assert client.posts() == {}


def test_the_low_level_steps_record_intent_outcome_and_a_late_answer(engine: Engine) -> None:
    """begin / mark_unknown / record_outcome on the caller's connection; a definite answer
    arriving for an operation a human owns is kept as evidence, not applied."""
    with engine.begin() as conn:
        intent = LEDGER.begin(conn, key="k-low", system="supplier", operation="place-order",
                              request=ORDER)
    assert intent.created
    assert intent.operation.status is OperationStatus.PENDING
    with engine.begin() as conn:
        unknown = LEDGER.mark_unknown(conn, intent.operation.id, reason="read timed out")
    assert unknown.status is OperationStatus.UNKNOWN
    with engine.begin() as conn:
        conn.execute(update(operations).where(operations.c.id == unknown.id)
                     .values(status="needs-human"))
    late = Applied(Evidence(reference="ORD-late"))
    with engine.begin() as conn:
        after = LEDGER.record_outcome(conn, unknown.id, late)
    assert after.status is OperationStatus.NEEDS_HUMAN
    assert after.reference is None
    assert trail(engine, after)[-1] == ("late-outcome", "confirmed")
    with engine.begin() as conn:
        conn.execute(update(operations).where(operations.c.id == unknown.id)
                     .values(status="unknown"))
        confirmed = LEDGER.record_outcome(conn, unknown.id, late)
    assert confirmed.status is OperationStatus.CONFIRMED
    assert confirmed.reference == "ORD-late"
