"""The app ``outbox worker`` runs in tests/e2e/test_commit_answer_lost.py: a supplier order.

Its step emits the order and waits for the supplier's answer, in one transaction. For a run
whose checkpoint says ``cut``, the step's last act is to tell the Toxiproxy in front of the
worker's PostgreSQL connections (``TEST_TOXIPROXY_API``, proxy ``TEST_TOXIPROXY_PROXY``) to
close every connection at the next byte the server sends: the COMMIT that follows reaches the
server, and its answer never reaches the worker.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from outbox import App, ClaimedRun, Envelope
from outbox.testing.toxiproxy import Client

app = App()
ORDER_TOPIC = os.environ.get("TEST_ORDER_TOPIC", "answer-lost-orders")


class Order(BaseModel):
    item: str
    qty: int
    cut: bool = False
    ordered: bool = False
    supplier_ref: str | None = None


@app.workflow("supplier-order", version="1", signals=["supplier-answer"])
def supplier_order(job: ClaimedRun[Order]) -> None:
    order = job.checkpoint
    if not order.ordered:
        job.emit(Envelope(topic=ORDER_TOPIC, type="order.submit", key="supplier-acme",
                          payload={"item": order.item, "qty": order.qty}))
        order.ordered = True
        job.wait_for_signal("supplier-answer", step="ordered", checkpoint=order)
        if order.cut:
            _lose_the_commits_answer()
        return
    answer = job.receive("supplier-answer")
    if answer is None:
        job.wait_for_signal("supplier-answer", step="ordered")
        return
    order.supplier_ref = str(answer.payload["ref"])
    job.save_checkpoint(order, step="answered")  # returning: the run is done


def _lose_the_commits_answer() -> None:
    # limit_data of 0 bytes downstream: the proxy passes the worker's COMMIT on to the server
    # and closes the connection at the first byte of the answer.
    Client(os.environ["TEST_TOXIPROXY_API"]).limit_data(os.environ["TEST_TOXIPROXY_PROXY"], 0)
