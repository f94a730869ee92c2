"""The agent: one decision per supplier-order run; outbox's worker commits it (checkpoint,
``order.submit``, ``waiting``) in ONE transaction. Killed before, nothing of it exists: the lease
expires and a worker resumes from the last commit. ``python -m examples.supplier_order.agent
--worker agent-1`` (or ``outbox worker examples.supplier_order.agent:app``)."""

from __future__ import annotations

import signal
import sys
import threading
import uuid
from collections.abc import Iterable

from pydantic import BaseModel
from sqlalchemy import Engine

from examples.supplier_order import config
from outbox import App, ClaimedRun, Envelope
from outbox.runtime import configure_logging
from outbox.worker import WorkerSettings, run_worker

app = App()


class Order(BaseModel):
    item: str
    qty: int
    account: str


@app.workflow(config.WORKFLOW, version=config.WORKFLOW_VERSION)
def decide(job: ClaimedRun[Order]) -> None:
    order = job.checkpoint
    job.save_checkpoint({**order.model_dump(), "decision": "order"}, step="decided")
    job.emit(Envelope(topic=config.topic(), type="order.submit", key=order.account,
                      payload={"run_id": str(job.run.id), "item": order.item, "qty": order.qty}))
    job.transition("waiting", step="order-submitted",
                   reason="decided to order; waiting for the supplier's confirmation",
                   evidence={"decision": f"order {order.qty} x {order.item}"})


def seed(engine: Engine, items: Iterable[str], *, batch: str,
         accounts: int = config.ACCOUNTS) -> list[uuid.UUID]:
    """Queue one run per item (idempotent per *batch* and position) over *accounts* accounts
    (the message keys); return their ids."""
    with engine.begin() as conn:
        return [app.start_run(conn, decide, idempotency_key=f"{batch}-{i}",
                              checkpoint=Order(item=item, qty=i % 5 + 1,
                                               account=config.account_of(i, accounts))).id
                for i, item in enumerate(items)]


if __name__ == "__main__":
    name = (sys.argv[sys.argv.index("--worker") + 1] if "--worker" in sys.argv
            else f"agent-{uuid.uuid4().hex[:6]}")
    configure_logging("text", "INFO")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # A short lease: a killed worker's run is resumed within seconds.
    raise SystemExit(run_worker(app, stop=stop, settings=WorkerSettings(
        database_url=config.database_url(), name=name, lease_seconds=3.0, poll_seconds=1.0)))
