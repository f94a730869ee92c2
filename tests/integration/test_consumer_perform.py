"""ctx.perform: one outside call per message however often it is delivered (real PostgreSQL,
records built by hand as in test_dedup_processing)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, select

from consumers import HandlerContext
from consumers.metrics import ConsumerMetrics
from consumers.processing import Processor
from dedup.ledger import Applied, Evidence, NotFound, Operation, OperationStatus, System
from outbox.db.schema import translate
from outbox.db.tables import operations
from outbox.settings import OutboxSettings
from tests.integration.test_dedup_processing import FakeSender, app_for, drain, record


class Order(BaseModel):
    n: int


class Supplier:
    """An outside system that counts the calls it gets, per request."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def call(self, op: Operation) -> Applied:
        self.calls.append(op.request["n"])
        return Applied(Evidence(reference=f"ORD-{op.request['n']}"))

    def system(self) -> System:
        return System("supplier", self.call, lambda op: NotFound())


@pytest.mark.parametrize("mode", ["batch", "per-message"])
def test_a_redelivered_message_performs_its_operation_once(
    engine: Engine, database_url: str, mode: str
) -> None:
    """The handler raises after its operation was applied: its transaction rolls back, the
    message is retried, and the retry finds the operation recorded instead of calling again.
    A redelivery after the commit is dropped by the dedup mark."""
    bound = engine.execution_options(schema_translate_map=translate(OutboxSettings()))
    app = app_for(database_url, mode, backoff_initial_seconds=0.05)
    supplier = Supplier()
    seen: list[OperationStatus] = []

    def place(ctx: HandlerContext, order: Order) -> None:
        op = ctx.perform(system=supplier.system(), operation="place-order",
                         request={"n": order.n})
        seen.append(op.status)
        if len(seen) == 1:
            raise RuntimeError("the handler fails after the call: rolled back, retried")

    app.register("items", place)
    processor = Processor(app, bound, ConsumerMetrics(), FakeSender())
    records = [record(0, {"n": 7})]
    assert drain(processor, records) == 1
    assert drain(processor, records) == 1  # delivered again: a duplicate, dropped

    assert supplier.calls == [7]
    assert seen == [OperationStatus.CONFIRMED, OperationStatus.CONFIRMED]
    with bound.connect() as conn:
        (row,) = conn.execute(select(operations)).mappings().all()
    message_id = records[0].headers[0][1].decode()
    assert row["message_id"] == message_id
    assert row["reference"] == "ORD-7"
    assert row["calls"] == 1
