"""The checkout saga (examples/saga) as separate OS processes: two workers, a relay and two
consumers on a real PostgreSQL and Kafka, three outside systems over HTTP (examples/supplier),
shipping refusing every booking. Workers, the relay and consumers are SIGKILLed at random
moments while the runs compensate, and restarted. Every run still ends compensated, each
charge refunded and each reservation released exactly once, the refund first, and the
refused booking never undone (there is nothing to undo)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from examples.saga import SYSTEMS, invariants, kills
from examples.saga import pipeline as saga_pipeline
from examples.saga.workflow import seed
from examples.supplier import Supplier, start_supplier
from examples.supplier_client import SupplierClient
from examples.supplier_order.pipeline import Pipeline

pytestmark = pytest.mark.timeout(240)

RUNS = 10
KILLS = 8
# One undo call at a time per consumer (per-message mode would make 16 at once and the
# ten sagas would be undone before the kills could land inside the undoing).
ONE_AT_A_TIME = {"OUTBOXKIT_CONSUMER_CONCURRENCY": "1"}


@pytest.fixture
def systems() -> Iterator[dict[str, Supplier]]:
    started = {name: start_supplier() for name in SYSTEMS}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture
def pipeline(database_url: str, kafka_bootstrap: str, tmp_path: Path,
             systems: dict[str, Supplier]) -> Iterator[Pipeline]:
    p = saga_pipeline.start(
        database_url=database_url, bootstrap=kafka_bootstrap, workdir=tmp_path / "logs",
        urls={name: s.url for name, s in systems.items()},
        processes=[("worker", "worker-1"), ("worker", "worker-2"), ("relay", "relay-1"),
                   ("consumer", "consumer-1"), ("consumer", "consumer-2")],
        env=ONE_AT_A_TIME)
    try:
        yield p
    finally:
        p.stop_all()


def test_killed_workers_relays_and_consumers_undo_each_effect_once_last_first(
        engine: Engine, pipeline: Pipeline, systems: dict[str, Supplier]) -> None:
    clients = {name: SupplierClient(s.url) for name, s in systems.items()}
    clients["shipping"].control(orders={"mode": "refuse"})
    for name in ("stock", "payments"):  # slow answers: the kills land inside the undoing
        clients[name].control(orders={"mode": "slow", "delay": 0.5})
    orders = [f"order-{i}" for i in range(RUNS)]
    ids = seed(engine, orders)
    killed = kills.during_compensation(engine, ids, [(pipeline, list(pipeline.procs))],
                                       random.Random(int(uuid.uuid4()) % 10**6), kills=KILLS)
    assert kills.wait_failed(engine, ids, lambda: kills.restart_dead(pipeline),
                             timeout_s=150), (
        f"runs not all failed after compensating: {kills.states(engine, ids)} (killed "
        f"{killed}); logs in {pipeline.workdir}")
    assert len(killed) >= 4, f"only {len(killed)} kills landed while runs compensated"
    assert invariants.check(engine, ids, orders, clients) == [], killed
