"""Reconciliation: unknown outcomes are settled by asking the supplier, or escalated."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import Engine

from dedup.ledger import Ledger, Operation, OperationStatus, StatusOutcome, System
from examples.supplier import Supplier
from examples.supplier_client import SupplierClient
from outbox.runs.lifecycle import history as run_history
from tests.integration.operations_support import (
    fast_policy,
    history,
    reload,
    run_state,
    supplier_and_client,
    trail,
    waiting_run,
)

LEDGER = Ledger()

ORDER = {"item": "widget", "qty": 3}


@pytest.fixture
def supplier() -> Iterator[tuple[Supplier, SupplierClient]]:
    yield from supplier_and_client(timeout=1.0)


def test_applied_then_timed_out_is_confirmed_by_status_query_with_exactly_one_order(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    policy = fast_policy()
    client.control(orders={"mode": "apply-then-timeout", "delay": 2.0, "times": 1})
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id="m-1", policy=policy)
    assert op.status is OperationStatus.UNKNOWN  # never "failed": it may have been applied

    LEDGER.reconcile_due(engine, [client.system()], policy=policy)

    settled = reload(engine, op)
    assert settled.status is OperationStatus.CONFIRMED
    assert settled.calls == 1
    assert settled.checks == 1
    [order] = client.all_orders()
    assert order["order_id"] == settled.reference
    assert order["posts"] == 1


def test_dropped_connection_after_applying_is_also_settled_by_status_query(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    client.control(orders={"mode": "apply-then-drop", "times": 1})
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id="m-1", policy=fast_policy())
    assert op.status is OperationStatus.UNKNOWN
    assert "RemoteDisconnected" in (op.last_error or "")
    LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())
    assert reload(engine, op).status is OperationStatus.CONFIRMED
    assert len(client.all_orders()) == 1
    assert client.posts() == {op.idempotency_key: 1}


def test_status_endpoint_down_escalates_operation_and_run_to_needs_human_with_every_check(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    run_id = waiting_run(engine)
    policy = fast_policy(max_checks=3)
    client.control(orders={"mode": "apply-then-timeout", "delay": 2.0, "times": 1},
                   status={"mode": "down"})
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id="m-1", run_id=run_id, policy=policy)
    assert op.status is OperationStatus.UNKNOWN

    passes = [LEDGER.reconcile_due(engine, [client.system()], policy=policy) for _ in range(4)]
    assert [p.statuses for p in passes] == [
        {"unknown": 1}, {"unknown": 1}, {"needs-human": 1}, {}]  # bounded: nothing loops

    escalated = reload(engine, op)
    assert escalated.status is OperationStatus.NEEDS_HUMAN
    assert escalated.checks == 3
    assert escalated.calls == 1
    assert escalated.next_check_at is None
    assert trail(engine, op) == [
        ("intent", "pending"), ("call", "unknown"), ("check", "unclear"), ("check", "unclear"),
        ("check", "unclear"), ("escalation", "needs-human")]
    # The evidence is every event up to the escalation, each check's answer included.
    evidence = escalated.evidence
    assert "after 3 status queries" in evidence["reason"]
    assert [e["kind"] for e in evidence["events"]] == [
        "intent", "call", "check", "check", "check"]
    assert all("HTTP 503" in e["detail"]["reason"]
               for e in evidence["events"] if e["kind"] == "check")
    # The run went to needs-human in the same transaction, with the same evidence.
    assert run_state(engine, run_id) == "needs-human"
    with engine.connect() as conn:
        last = run_history(conn, run_id)[-1]
    assert (last.from_state, last.to_state, last.actor) == ("waiting", "needs-human",
                                                            "reconciler")
    assert last.evidence["operation"]["idempotency_key"] == op.idempotency_key
    assert "moved to needs-human" in history(engine, op)[-1].detail["run"]
    # No second order was created blindly: one POST, one order.
    assert client.posts() == {op.idempotency_key: 1}
    assert len(client.all_orders()) == 1


def test_unclear_checks_back_off_between_queries(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    policy = fast_policy(initial_backoff=30.0)
    client.control(orders={"mode": "drop", "times": 1}, status={"mode": "down"})
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id="m-1", policy=fast_policy())
    assert LEDGER.reconcile_due(engine, [client.system()], policy=policy).statuses == {"unknown": 1}
    after = reload(engine, op)
    assert after.next_check_at is not None
    assert (after.next_check_at - after.updated_at).total_seconds() == pytest.approx(30, abs=1)
    assert LEDGER.reconcile_due(engine, [client.system()], policy=policy).claimed == 0  # not due


def test_definitely_not_found_is_retried_with_the_same_key_and_confirmed_once(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    client.control(orders={"mode": "drop", "times": 1})  # lost before the supplier applied it
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id="m-1", policy=fast_policy())
    assert op.status is OperationStatus.UNKNOWN
    assert client.all_orders() == []

    LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())

    settled = reload(engine, op)
    assert settled.status is OperationStatus.CONFIRMED
    assert settled.calls == 2
    assert trail(engine, op) == [
        ("intent", "pending"), ("call", "unknown"), ("check", "not-found"),
        ("retry", "pending"), ("call", "confirmed")]
    retry = history(engine, op)[3]
    assert retry.detail["idempotency_key"] == op.idempotency_key
    [order] = client.all_orders()
    assert order["idempotency_key"] == op.idempotency_key
    assert order["posts"] == 2


def test_not_found_after_max_calls_goes_to_a_human_instead_of_calling_again(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    policy = fast_policy(max_calls=2)
    client.control(orders={"mode": "drop"})
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id="m-1", policy=policy)
    for _ in range(4):
        LEDGER.reconcile_due(engine, [client.system()], policy=policy)
    final = reload(engine, op)
    assert final.status is OperationStatus.NEEDS_HUMAN
    assert final.calls == 2
    assert "not found after 2 calls" in final.evidence["reason"]
    assert client.posts() == {op.idempotency_key: 2}


def test_two_reconcilers_at_once_never_query_the_same_operation_twice(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    """SKIP LOCKED claims: concurrent passes (other processes, in production) split the
    due operations between them instead of both asking about each."""
    _, client = supplier
    client.control(orders={"mode": "drop", "times": 6})
    ops = [LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                          message_id=f"m-{i}", policy=fast_policy()) for i in range(6)]
    assert {op.status for op in ops} == {OperationStatus.UNKNOWN}
    asked: Counter[str] = Counter()
    lock = threading.Lock()

    def slow_found(op: Operation) -> StatusOutcome:
        with lock:
            asked[op.idempotency_key] += 1
        time.sleep(0.2)  # both passes are surely running at the same time
        return client.order_status(op)

    system = System("supplier", call=client.place_order, status_query=slow_found)
    barrier = threading.Barrier(2)

    def run() -> None:
        barrier.wait()
        LEDGER.reconcile_due(engine, [system], policy=fast_policy(), limit=3)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(asked.values()) == [1] * 6
    assert {reload(engine, op).status for op in ops} == {OperationStatus.CONFIRMED}
    assert len(client.all_orders()) == 6
    assert set(client.posts().values()) == {2}


def test_the_scheduled_job_settles_unknown_operations_in_the_background(
    engine: Engine, supplier: tuple[Supplier, SupplierClient]
) -> None:
    _, client = supplier
    client.control(orders={"mode": "apply-then-drop", "times": 1})
    op = LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                        message_id="m-1", policy=fast_policy())
    scheduler = BackgroundScheduler()
    job = LEDGER.add_reconcile_job(scheduler, engine, [client.system()], interval_seconds=0.2,
                                   policy=fast_policy())
    assert job.max_instances == 1
    scheduler.start()
    try:
        deadline = time.monotonic() + 15
        while reload(engine, op).status is not OperationStatus.CONFIRMED:
            assert time.monotonic() < deadline, "the job did not settle the operation"
            time.sleep(0.1)
    finally:
        scheduler.shutdown(wait=True)
    assert client.posts() == {op.idempotency_key: 1}
