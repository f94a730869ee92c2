"""The checkout saga (examples/saga) as separate OS processes: two workers, a relay and two
consumers on a real PostgreSQL and Kafka, three outside systems over HTTP (examples/supplier),
shipping refusing every booking. Workers, the relay and consumers are SIGKILLed at random
moments while the runs compensate, and restarted. Every run still ends compensated, each
charge refunded and each reservation released exactly once, the refund first, and the
refused booking never undone (there is nothing to undo)."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient, NewTopic
from sqlalchemy import Engine, text

from examples.saga import SYSTEMS
from examples.saga.workflow import seed
from examples.supplier import Supplier, start_supplier
from examples.supplier_client import SupplierClient
from examples.supplier_order.pipeline import Pipeline

pytestmark = pytest.mark.timeout(240)

COMMANDS = {
    "worker": ["-m", "outbox.cli.main", "worker", "examples.saga.workflow:app"],
    "relay": ["-m", "relay"],
    "consumer": ["-m", "consumers", "examples.saga.consumer:app"],
}
RUNS = 10
KILLS = 8


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
    prefix = f"checkout-{uuid.uuid4().hex[:8]}"
    p = Pipeline(database_url=database_url, bootstrap=kafka_bootstrap, topic=prefix,
                 group=f"{prefix}-effects", workdir=tmp_path / "logs", commands=COMMANDS)
    urls = {f"OUTBOXKIT_EXAMPLE_{name.upper()}_URL": s.url for name, s in systems.items()}
    for kind in COMMANDS:
        p.overrides[kind] = {**urls, "OUTBOXKIT_WORKER_LEASE_SECONDS": "3",
                             "OUTBOXKIT_WORKER_POLL_SECONDS": "1"}
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:  # created up front, as the consumers then join with every partition known
        admin.create_topics([NewTopic(f"{prefix}.{name}", 3, 1) for name in SYSTEMS])
    finally:
        admin.close()
    for kind, name in [("worker", "worker-1"), ("worker", "worker-2"), ("relay", "relay-1"),
                       ("consumer", "consumer-1"), ("consumer", "consumer-2")]:
        p.start(kind, name)
    try:
        yield p
    finally:
        p.stop_all()


def _states(engine: Engine, ids: list[uuid.UUID]) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT state, count(*) FROM outboxkit.agent_runs "
                                 "WHERE id = ANY(:ids) GROUP BY state"), {"ids": ids}).all()
    return {state: count for state, count in rows}


def _compensating(engine: Engine, ids: list[uuid.UUID]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM outboxkit.agent_runs WHERE id = ANY(:ids) "
            "AND compensating_since IS NOT NULL"), {"ids": ids}).scalar_one())


def test_killed_workers_relays_and_consumers_undo_each_effect_once_last_first(
        engine: Engine, pipeline: Pipeline, systems: dict[str, Supplier]) -> None:
    clients = {name: SupplierClient(s.url) for name, s in systems.items()}
    clients["shipping"].control(orders={"mode": "refuse"})
    for name in ("stock", "payments"):  # slow answers: the kills land inside the undoing
        clients[name].control(orders={"mode": "slow", "delay": 0.5})
    orders = [f"order-{i}" for i in range(RUNS)]
    ids = seed(engine, orders)
    rng = random.Random(int(uuid.uuid4()) % 10**6)
    deadline = time.monotonic() + 60
    while _compensating(engine, ids) == 0:  # the kills start once compensation does
        assert time.monotonic() < deadline, "no run began compensating in 60 s"
        time.sleep(0.1)
    victims = [n for n in pipeline.procs]
    killed: list[str] = []
    during = 0  # kills while some run was compensating
    for _ in range(KILLS):
        time.sleep(rng.uniform(0.05, 0.5))
        if _compensating(engine, ids) == 0:
            break  # every run is undone: later kills would prove nothing here
        victim = rng.choice(victims)
        pipeline.kill(victim)
        killed.append(victim)
        during += 1
        time.sleep(rng.uniform(0.1, 0.4))
        pipeline.restart(victim)
    deadline = time.monotonic() + 150
    while _states(engine, ids) != {"failed": RUNS}:
        for name in pipeline.dead():
            pipeline.restart(name)
        assert time.monotonic() < deadline, (
            f"runs not all failed after compensating: {_states(engine, ids)} (killed "
            f"{killed}); logs in {pipeline.workdir}")
        time.sleep(0.5)

    assert during >= 4, f"only {during} kills landed while runs compensated"
    with engine.connect() as conn:
        reasons = conn.execute(text("SELECT reason FROM outboxkit.agent_runs WHERE id = ANY(:ids)"),
                               {"ids": ids}).scalars().all()
        effects = conn.execute(text(
            "SELECT type, state, count(*) FROM outboxkit.run_effects WHERE run_id = ANY(:ids) "
            "GROUP BY type, state ORDER BY type"), {"ids": ids}).all()
    assert set(reasons) == {"compensated: 2 effect(s) undone"}, killed
    assert {(t, s): n for t, s, n in effects} == {
        ("book", "not-applied"): RUNS, ("charge", "compensated"): RUNS,
        ("reserve", "compensated"): RUNS}
    records = {name: client.record() for name, client in clients.items()}
    for name, done, undone in [("stock", "reserve", "release"),
                               ("payments", "charge", "refund")]:
        by_order: dict[str, list[str]] = {}
        for placed in records[name]["orders"]:
            op, order = placed["request"]["item"].split(":")
            by_order.setdefault(order, []).append(op)
        assert by_order == {o: [done, undone] for o in orders}, (name, killed)  # once each
        assert not records[name]["repeat_posts"], (name, killed)  # never called twice
    assert records["shipping"]["orders"] == []
    # the last first: each order's refund was placed before its release
    placed_at = {(name, o["request"]["item"]): o["created_at"]
                 for name in ("stock", "payments") for o in records[name]["orders"]}
    for order in orders:
        assert placed_at[("payments", f"refund:{order}")] < placed_at[("stock",
                                                                         f"release:{order}")]
