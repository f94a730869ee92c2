"""The checkout run: one effect per step, each emitted with its undo; a refusal undoes the
rest (``outbox worker examples.saga.workflow:app``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from pydantic import BaseModel
from sqlalchemy import Engine

from examples.saga import STEPS, topic
from outbox import App, ClaimedRun, Envelope

app = App()


class Order(BaseModel):
    order_id: str


@app.workflow("checkout", version="1")
def checkout(job: ClaimedRun[Order]) -> None:
    done = job.effects()
    # The ledger resumed the run with the last effect's outcome as its evidence.
    if done and job.run.last_evidence["status"] != "confirmed":
        job.compensate(reason=f"{done[-1].type} refused", evidence=job.run.last_evidence)
        return
    if len(done) == len(STEPS):
        return  # every effect confirmed: the run is done
    system, ask, undo = STEPS[len(done)]
    order = job.checkpoint.order_id
    job.emit(Envelope(topic=topic(system), type=ask, key=order,
                      payload={"op": ask, "order": order}),
             compensation=Envelope(topic=topic(system), type=undo, key=order,
                                   payload={"op": undo, "order": order}))
    job.transition("waiting", step=ask, reason=f"{ask} sent to {system}")


def seed(engine: Engine, orders: Iterable[str]) -> list[uuid.UUID]:
    """Start one checkout per order id (idempotent by it); return the runs' ids."""
    with engine.begin() as conn:
        return [app.start_run(conn, checkout, idempotency_key=order,
                              checkpoint=Order(order_id=order)).id for order in orders]
