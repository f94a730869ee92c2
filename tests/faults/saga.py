"""The fault harness's compensation scenario: checkout sagas (examples/saga) undo their
effects while the harness's relays, and saga workers and consumers of their own, are
SIGKILLed at random; the saga's invariants (examples/saga/invariants.py) then hold."""

from __future__ import annotations

import time
import uuid

from examples.saga import SYSTEMS, invariants, kills
from examples.saga import pipeline as saga_pipeline
from examples.saga.workflow import seed
from examples.supplier import Supplier, start_supplier
from examples.supplier_client import SupplierClient
from examples.supplier_order.pipeline import Pipeline
from tests.faults.harness import Harness, ScenarioResult
from tests.faults.scenarios import Scenario

SAGAS = 10


def saga_kills(rounds: int = 8) -> Scenario:
    """10 sagas whose last effect (shipping) is refused, so each undoes the two before it;
    up to *rounds* SIGKILLs, while some run compensates, of a relay of the harness or a saga
    worker or consumer (two of each, started for the scenario), each restarted at once."""

    def run(h: Harness, r: ScenarioResult) -> list[uuid.UUID]:
        assert h.engine is not None
        servers: dict[str, Supplier] = {}
        p: Pipeline | None = None
        try:
            servers.update({name: start_supplier() for name in SYSTEMS})
            clients = {name: SupplierClient(s.url) for name, s in servers.items()}
            clients["shipping"].control(orders={"mode": "refuse"})
            for name in ("stock", "payments"):  # slow answers: the kills land in the undoing
                clients[name].control(orders={"mode": "slow", "delay": 0.5})
            p = saga_pipeline.start(
                database_url=h.p.database_url, bootstrap=h.p.bootstrap,
                workdir=h.workdir / "logs" / "saga",
                urls={n: s.url for n, s in servers.items()},
                processes=[("worker", "saga-worker-1"), ("worker", "saga-worker-2"),
                           ("consumer", "saga-consumer-1"), ("consumer", "saga-consumer-2")],
                env={"OUTBOXKIT_CONSUMER_CONCURRENCY": "1"})  # the kills land in the undoing
            orders = [f"saga-{h.seed}-{uuid.uuid4().hex[:4]}-{i}" for i in range(SAGAS)]
            ids = seed(h.engine, orders)
            killed = kills.during_compensation(
                h.engine, ids, [(p, list(p.procs)), (h.p, h.names("relay"))], h.rng,
                kills=rounds)
            r.kills += len(killed)
            r.notes.append(f"killed while compensating: {', '.join(killed) or 'none'}")
            if not killed:
                r.unexpected.append("no kill landed while the sagas compensated")
            r.fault_ended = time.monotonic()
            saga = p
            if not kills.wait_failed(h.engine, ids, lambda: (kills.restart_dead(saga),
                                                            h.heal()), timeout_s=150):
                r.unexpected.append(f"sagas not all undone in 150 s: "
                                    f"{kills.states(h.engine, ids)}")
            r.unexpected += invariants.check(h.engine, ids, orders, clients)
        finally:
            if p is not None:
                p.stop_all()
            for server in servers.values():
                server.stop()
        return []  # the supplier-order invariants have nothing to say about these runs

    return Scenario(f"saga-kills:{rounds}", run, settle_s=5)
