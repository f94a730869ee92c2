"""The agent: runs of the supplier-order workflow, one decision each.

``seed`` queues runs (one per order to place). A worker process claims them one at a time
and commits, in ONE transaction: the checkpoint of its decision, the move to ``waiting`` and
the ``order.submit`` message. If it dies anywhere before that commit, nothing of the step
exists; the lease expires and another worker (or the same one, restarted) takes the run
over from its last committed state — never from what it "remembers".

    python -m examples.supplier_order.agent --worker agent-1
"""

from __future__ import annotations

import argparse
import signal
import threading
import uuid
from collections.abc import Iterable

from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import OperationalError

from examples.supplier_order import config
from outbox import Envelope, claim, start_run
from outbox.db.dsn import sqlalchemy_url

LEASE_SECONDS = 3.0  # short, so a killed worker's run is resumed within seconds


def seed(engine: Engine, items: Iterable[str], *, batch: str) -> list[uuid.UUID]:
    """Queue one run per item (idempotent per *batch* and position); return their ids."""
    run_ids = []
    with engine.begin() as conn:
        for i, item in enumerate(items):
            run = start_run(
                conn, workflow=config.WORKFLOW, workflow_version=config.WORKFLOW_VERSION,
                idempotency_key=f"{batch}-{i}",
                checkpoint={"item": item, "qty": i % 5 + 1, "account": config.account_of(i)},
            )
            run_ids.append(run.id)
    return run_ids


def step(engine: Engine, worker: str) -> bool:
    """Take one run through its decision; False when nothing is runnable."""
    with engine.begin() as conn:
        claimed = claim(conn, worker=worker, lease_seconds=LEASE_SECONDS,
                        workflows=[config.WORKFLOW])
    if claimed is None:
        return False
    run_id, order = claimed.run.id, dict(claimed.run.checkpoint)
    with engine.begin() as conn:  # the state change and the effect message commit together
        job = claimed.on(conn)  # the claim committed: go on from its lease in this transaction
        job.save_checkpoint({**order, "decision": "order"}, step="decided")
        job.emit(Envelope(
            topic=config.topic(), type="order.submit", key=order["account"],
            payload={"run_id": str(run_id), "item": order["item"], "qty": order["qty"]},
        ))  # the handle sets the message's run_id
        job.transition("waiting", step="order-submitted", actor=worker,
                       reason="decided to order; waiting for the supplier's confirmation",
                       evidence={"decision": f"order {order['qty']} x {order['item']}"})
    return True


def work(engine: Engine, worker: str, stop: threading.Event, idle_s: float = 0.2) -> int:
    """Step until *stop* is set; return how many runs this worker moved on."""
    done = 0
    while not stop.is_set():
        try:
            moved = step(engine, worker)
        except OperationalError as exc:
            # The database restarted or is unreachable: nothing of the step committed, so
            # wait and carry on; the run's lease expires and it is claimed again.
            print(f"{worker}: database unavailable ({type(exc.orig).__name__}); retrying",
                  flush=True)
            stop.wait(1.0)
            continue
        if moved:
            done += 1
        else:
            stop.wait(idle_s)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a supplier-order agent worker")
    parser.add_argument("--worker", default=f"agent-{uuid.uuid4().hex[:6]}")
    args = parser.parse_args(argv)
    engine = create_engine(sqlalchemy_url(config.database_url()), pool_size=2,
                           pool_pre_ping=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        done = work(engine, args.worker, stop)
    finally:
        engine.dispose()
    print(f"{args.worker}: {done} runs decided", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
