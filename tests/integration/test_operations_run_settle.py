"""Whatever settles an operation settles the run that waits on it, in the same transaction,
with the outside system's evidence: the call's answer, a reconciler's status query or retry,
a person's resolution. A run that cannot move never undoes the operation's outcome."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select

from consumers import HandlerContext
from dedup.ledger import Evidence, Ledger, OnSettle, Operation, OperationStatus
from examples.supplier import Supplier
from examples.supplier_client import SupplierClient
from outbox.db.tables import agent_runs, operations
from outbox.errors import ConfigurationError
from outbox.handle import claim
from outbox.runs.lifecycle import get_run, history, move
from tests.integration.operations_support import (
    fast_policy,
    supplier_and_client,
    trail,
    waiting_run,
)
from tests.integration.operations_support import history as op_history

LEDGER = Ledger()

ORDER = {"item": "widget", "qty": 3}


@pytest.fixture
def supplier() -> Iterator[tuple[Supplier, SupplierClient]]:
    yield from supplier_and_client(timeout=1.0)


def _place(engine: Engine, client: SupplierClient, run_id: uuid.UUID, *,
           message_id: str = "m-1", **kwargs: Any) -> Operation:
    return LEDGER.perform(engine, system=client.system(), operation="place-order", request=ORDER,
                          message_id=message_id, run_id=run_id,
                          policy=kwargs.pop("policy", fast_policy()), actor="orders", **kwargs)


def _run(engine: Engine, run_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        return dict(conn.execute(select(agent_runs).where(agent_runs.c.id == run_id))
                    .one()._mapping)


def _same_transaction(engine: Engine, op: Operation, run_id: uuid.UUID) -> bool:
    """now() is the transaction's start: the operation's resolved_at equals the run's
    finished_at only when one transaction wrote both."""
    with engine.connect() as conn:
        resolved = conn.execute(select(operations.c.resolved_at)
                                .where(operations.c.id == op.id)).scalar_one()
    return bool(resolved is not None and resolved == _run(engine, run_id)["finished_at"])


def _moves(engine: Engine, run_id: uuid.UUID) -> list[tuple[str | None, str]]:
    with engine.connect() as conn:
        return [(t.from_state, t.to_state) for t in history(conn, run_id)]


def _escalated(engine: Engine, client: SupplierClient, run_id: uuid.UUID,
               orders_mode: str) -> Operation:
    """An order whose outcome nobody could establish: operation and run are needs-human."""
    client.control(orders={"mode": orders_mode, "delay": 2.0, "times": 1},
                   status={"mode": "down"})
    policy = fast_policy(max_checks=1)
    op = _place(engine, client, run_id, policy=policy)
    LEDGER.reconcile_due(engine, [client.system()], policy=policy)
    client.control(status={"mode": "normal"})
    with engine.connect() as conn:
        assert get_run(conn, run_id).state.value == "needs-human"
    return op


class TestTheCallsOwnAnswer:
    def test_applied_finishes_the_waiting_run_done_with_the_suppliers_evidence(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        run_id = waiting_run(engine)
        op = _place(engine, client, run_id)
        assert op.status is OperationStatus.CONFIRMED
        run = _run(engine, run_id)
        [order] = client.all_orders()
        assert (run["state"], run["step"]) == ("done", "done")
        evidence = run["last_evidence"]
        assert evidence["reference"] == order["order_id"] == op.reference
        assert (evidence["operation_id"], evidence["calls"], evidence["checks"]) == (
            str(op.id), 1, 0)
        assert evidence["answer"]["http_status"] in (200, 201)
        assert _same_transaction(engine, op, run_id)
        assert op_history(engine, op)[-1].detail["run"] == f"run {run_id} done"

    def test_refused_fails_the_run_with_the_refusal_as_evidence(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        client.control(orders={"mode": "refuse", "times": 1})
        run_id = waiting_run(engine)
        op = _place(engine, client, run_id)
        assert op.status is OperationStatus.REJECTED
        run = _run(engine, run_id)
        assert run["state"] == "failed"
        assert run["last_evidence"]["answer"]["http_status"] == 422
        assert run["last_evidence"]["answer"]["error"] == "refused"
        assert "rejected" in run["reason"]
        assert _same_transaction(engine, op, run_id)

    def test_a_handler_that_also_confirms_with_the_message_id_finds_it_applied(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        """perform settled the run under the message id: ctx.confirm is a no-op, not an
        IllegalTransition on a run that is already done."""
        _, client = supplier
        run_id = waiting_run(engine)
        message_id = str(uuid.uuid4())
        op = _place(engine, client, run_id, message_id=message_id)
        assert op.status is OperationStatus.CONFIRMED
        with engine.begin() as conn:
            ctx = HandlerContext(conn=conn, group_id="orders", message_id=message_id,
                                 topic="order.submit", partition=0, offset=0, key=None,
                                 run_id=run_id)
            assert ctx.confirm(outcome="done", evidence={"supplier_ref": op.reference}) is False
        assert _moves(engine, run_id)[-2:] == [("waiting", "running"), ("running", "done")]

    def test_resume_puts_the_run_back_to_running_for_its_worker(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        run_id = waiting_run(engine)
        op = _place(engine, client, run_id, on_settle="resume")
        assert (op.status, op.on_settle) == (OperationStatus.CONFIRMED, OnSettle.RESUME)
        run = _run(engine, run_id)
        assert (run["state"], run["step"], run["lease_owner"]) == (
            "running", "order-submitted", None)
        assert run["last_evidence"]["reference"] == op.reference
        with engine.begin() as conn:
            job = claim(conn, worker="worker-2", lease_seconds=30)
        assert job is not None
        assert job.run.id == run_id  # the worker carries on at once

    def test_an_unknown_on_settle_is_refused_before_anything_is_written(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        run_id = waiting_run(engine)
        with pytest.raises(ConfigurationError, match="on_settle must be one of"):
            _place(engine, client, run_id, on_settle="requeue")
        assert client.all_orders() == []
        assert _run(engine, run_id)["state"] == "waiting"

    def test_a_run_no_longer_waiting_keeps_the_outcome_and_the_event_says_why(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        run_id = waiting_run(engine)
        with engine.begin() as conn:
            move(conn, run_id, "failed", actor="ops", reason="cancelled by hand")
        op = _place(engine, client, run_id)
        assert op.status is OperationStatus.CONFIRMED
        assert _run(engine, run_id)["state"] == "failed"
        note = op_history(engine, op)[-1].detail["run"]
        assert note.startswith(f"run {run_id} not settled")
        assert "failed" in note


class TestTheReconciler:
    def test_a_consumer_killed_during_the_call_leaves_a_run_the_reconciler_settles(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        """The issue's repro at the ledger: the intent is committed, the supplier applies the
        order, the process dies before recording it (the message is dead-lettered
        meanwhile). The reconciler's status query confirms it and the run is done."""
        _, client = supplier
        run_id = waiting_run(engine)
        with engine.begin() as conn:
            intent = LEDGER.begin(conn, key="place-order:m-1", system="supplier",
                                  operation="place-order", request=ORDER, message_id="m-1",
                                  run_id=run_id, in_flight_grace=0.0)
        client.place_order(intent.operation)  # applied; the answer is never recorded
        assert _run(engine, run_id)["state"] == "waiting"

        report = LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())

        assert report.statuses == {"confirmed": 1}
        run = _run(engine, run_id)
        [order] = client.all_orders()
        assert run["state"] == "done"
        assert (run["last_evidence"]["reference"], run["last_evidence"]["checks"]) == (
            order["order_id"], 1)
        assert run["last_evidence"]["answer"]["via"] == "status-query"
        assert run["reason"].endswith(f"confirmed: {order['order_id']}")
        with engine.connect() as conn:
            resolved = conn.execute(select(operations.c.resolved_at)
                                    .where(operations.c.id == intent.operation.id)).scalar_one()
        assert resolved == run["finished_at"]

    def test_an_unknown_outcome_found_by_the_status_query_finishes_the_run(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        client.control(orders={"mode": "apply-then-timeout", "delay": 2.0, "times": 1})
        run_id = waiting_run(engine)
        op = _place(engine, client, run_id)
        assert op.status is OperationStatus.UNKNOWN
        assert _run(engine, run_id)["state"] == "waiting"
        LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())
        assert _run(engine, run_id)["state"] == "done"
        assert _same_transaction(engine, op, run_id)

    def test_not_found_then_the_retried_call_applied_finishes_the_run(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        client.control(orders={"mode": "drop", "times": 1})
        run_id = waiting_run(engine)
        op = _place(engine, client, run_id)
        assert op.status is OperationStatus.UNKNOWN
        LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())
        assert trail(engine, op)[-2:] == [("retry", "pending"), ("call", "confirmed")]
        run = _run(engine, run_id)
        assert (run["state"], run["last_evidence"]["calls"]) == ("done", 2)
        assert _same_transaction(engine, op, run_id)

    def test_the_retried_call_refused_fails_the_run(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        client.control(orders={"mode": "drop", "times": 1})
        run_id = waiting_run(engine)
        op = _place(engine, client, run_id)
        client.control(orders={"mode": "refuse", "times": 1})
        LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())
        assert trail(engine, op)[-1] == ("call", "rejected")
        assert _run(engine, run_id)["state"] == "failed"


class TestAPersonsResolution:
    def test_confirmed_by_a_person_brings_the_escalated_run_to_done_with_their_evidence(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        run_id = waiting_run(engine)
        op = _escalated(engine, client, run_id, "apply-then-timeout")
        [order] = client.all_orders()
        with engine.begin() as conn:
            resolved = LEDGER.resolve_confirmed(
                conn, op.id, evidence=Evidence(reference=order["order_id"],
                                               detail={"seen_in": "supplier portal"}),
                actor="alice@ops", reason="order visible in the portal")
        run = _run(engine, run_id)
        assert run["state"] == "done"
        evidence = run["last_evidence"]
        assert (evidence["reference"], evidence["resolved_by"]) == (order["order_id"],
                                                                    "alice@ops")
        assert evidence["answer"]["seen_in"] == "supplier portal"
        assert _moves(engine, run_id)[-4:] == [
            ("waiting", "needs-human"), ("needs-human", "waiting"), ("waiting", "running"),
            ("running", "done")]
        assert _same_transaction(engine, resolved, run_id)
        note = op_history(engine, op)[-1].detail["run"]
        assert note == f"run {run_id} back from needs-human to waiting, then done"

    def test_not_applied_by_a_person_makes_the_run_wait_for_the_call_made_again(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        run_id = waiting_run(engine)
        op = _escalated(engine, client, run_id, "drop")
        with engine.begin() as conn:
            LEDGER.resolve_not_applied(conn, op.id, actor="bob@ops",
                                       reason="supplier support: no order under this key")
        run = _run(engine, run_id)
        assert run["state"] == "waiting"
        assert "bob@ops" in run["reason"]

        LEDGER.reconcile_due(engine, [client.system()], policy=fast_policy())

        run = _run(engine, run_id)
        [order] = client.all_orders()
        assert (run["state"], run["last_evidence"]["reference"]) == ("done", order["order_id"])

    def test_a_run_needs_human_for_another_reason_is_left_to_the_person(
        self, engine: Engine, supplier: tuple[Supplier, SupplierClient]
    ) -> None:
        _, client = supplier
        run_id = waiting_run(engine)
        op = _escalated(engine, client, run_id, "apply-then-timeout")
        with engine.begin() as conn:  # a person took the run over meanwhile
            move(conn, run_id, "failed", actor="ops", reason="taking over")
            move(conn, run_id, "needs-human", actor="ops", reason="reviewing the order")
        [order] = client.all_orders()
        with engine.begin() as conn:
            LEDGER.resolve_confirmed(conn, op.id, evidence=Evidence(reference=order["order_id"]),
                                     actor="alice@ops", reason="seen in the portal")
        assert _run(engine, run_id)["state"] == "needs-human"
        assert "not settled" in op_history(engine, op)[-1].detail["run"]
