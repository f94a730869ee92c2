"""The reconciler: asks the supplier about orders whose outcome nobody saw.

    python -m examples.supplier_order.reconciler

An APScheduler interval job (:meth:`dedup.ledger.Ledger.add_reconcile_job`, one pass at a
time) claims due ``pending``/``unknown`` operations and settles them by the supplier's status
query: found → ``confirmed``; definitely not found → called again with the same key; unclear
too long → ``needs-human`` with every answer as evidence, and the run moves to needs-human too.
"""

from __future__ import annotations

import signal
import threading

from apscheduler.schedulers.background import BackgroundScheduler

from dedup.ledger import Ledger
from examples.supplier_order import config
from outbox.db.engines import engine_for


def main() -> int:
    # outboxkit's connection defaults (connect timeout, keepalives), and a bound on every
    # answer: its statements are small, so a database that hangs is noticed in 10 s.
    engine = engine_for(config.database_url(), pool_size=2, pool_pre_ping=True,
                        answer_timeout_s=10)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    scheduler = BackgroundScheduler()
    ledger = Ledger(policy=config.POLICY)  # the policy the consumer's ctx.perform is given
    ledger.add_reconcile_job(scheduler, engine, [config.supplier().system()],
                             interval_seconds=0.5, actor="reconciler")
    scheduler.start()
    try:
        stop.wait()
    finally:
        scheduler.shutdown(wait=True)
        engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
