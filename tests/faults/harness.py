"""The fault harness: the whole supplier-order pipeline as separate OS processes against a
PostgreSQL and a Kafka broker of its own (so it may stop and restart them), faults injected
while orders flow, and the invariants checked from the records after every scenario.

With ``cluster=True`` the pipeline runs on production's topology instead
(:mod:`tests.faults.topology`): a PostgreSQL primary with a synchronous standby behind a
failover URL, a 3-node Kafka cluster with the topic replicated 3 times, and a steady publish
probe (:mod:`tests.faults.probe`) that measures how long each fault stops publishing.

With ``proxied=True`` (the network scenarios, :mod:`tests.faults.network_scenarios`) every
process reaches PostgreSQL and Kafka only through Toxiproxy, through proxies of its own
(:mod:`tests.faults.network`), so a scenario can cut, slow or hang one path alone.

Every random choice comes from one seeded ``random.Random``: the same seed replays the same
scenario plan (which failpoint fires on which hit, which process is killed when). Timing
still varies from run to run, as it does in production.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text

from examples.supplier_client import SupplierClient
from examples.supplier_order import agent, invariants
from examples.supplier_order.pipeline import PARTITIONS, Pipeline
from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate
from outbox.testing.services import LocalServices
from tests.faults.network import Network
from tests.faults.probe import PARTITIONS as PROBE_PARTITIONS
from tests.faults.probe import TOPIC_CONFIGS, Probe, probe_topic
from tests.faults.topology import ClusterServices

FINAL = ("done", "failed", "needs-human")


@dataclass
class Topology:
    agents: int = 2
    relays: int = 2
    consumers: int = 2

    def names(self) -> list[tuple[str, str]]:
        return ([("agent", f"agent-{i + 1}") for i in range(self.agents)]
                + [("relay", f"relay-{i + 1}") for i in range(self.relays)]
                + [("consumer", f"consumer-{i + 1}") for i in range(self.consumers)]
                + [("reconciler", "reconciler")])


@dataclass
class ScenarioResult:
    name: str
    kills: int = 0
    recovery_s: float | None = None
    findings: invariants.Findings | None = None
    duplicates_dropped: int = 0
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    fault_ended: float | None = None  # monotonic time the last fault ended
    unexpected: list[str] = field(default_factory=list)  # runs that took the wrong path
    expected_paths: dict[str, str] = field(default_factory=dict)  # label → expected path
    run_labels: dict[str, str] = field(default_factory=dict)  # run id → label
    paths_taken: dict[str, str] = field(default_factory=dict)  # label → path taken
    figures: dict[str, Any] = field(default_factory=dict)  # a scenario's own measurements
    elapsed_s: float | None = None  # from the scenario's start to its last check
    # --- the cluster's figures -----------------------------------------------------------
    fault_window: tuple[float, float] | None = None  # time.time() of the first fault, its end
    unavailability_s: float | None = None  # the longest publish gap overlapping the window
    resent: int = 0  # records in Kafka more than once (the scenario's and the probe's)
    restarts: list[str] = field(default_factory=list)  # processes heal() had to restart
    probe: dict[str, Any] = field(default_factory=dict)  # acked, unknown, lost, resent
    probe_lost: list[str] = field(default_factory=list)  # acked probe messages not in Kafka

    @property
    def ok(self) -> bool:
        return (self.error is None and not self.unexpected and self.findings is not None
                and self.findings.ok and not self.probe_lost)


class Harness:
    """One database, one broker (or production's topology), one topic and one set of
    processes for a whole session."""

    def __init__(self, workdir: Path, *, seed: int, topology: Topology | None = None,
                 orders: int = 12, cluster: bool = False, proxied: bool = False) -> None:
        self.workdir, self.seed = workdir, seed
        self.cluster = ClusterServices(workdir) if cluster else None
        self.probe: Probe | None = None
        self.restarted: list[str] = []  # every process heal() restarted, in order
        self.rng = random.Random(seed)
        self.topology = topology or Topology()
        self.net = Network(workdir, self.topology.names()) if proxied else None
        self.orders = orders
        self.services = LocalServices(workdir / "services")
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.supplier: SupplierClient | None = None
        self._dup_seen: dict[tuple[str, int], float] = {}  # (name, pid) → last scrape
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    # --- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        database = "faults"
        if self.cluster is not None:
            url, bootstrap = self.cluster.up(database)
        else:
            if self.net is not None:
                server_url, bootstrap = self._start_proxied()
            else:
                endpoints = self.services.up()
                server_url, bootstrap = endpoints.database_url, endpoints.kafka_bootstrap
            admin = create_engine(sqlalchemy_url(server_url), isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
                conn.exec_driver_sql(f"CREATE DATABASE {database}")
                # The throwaway cluster defaults to synchronous_commit = off (speed), and a
                # PostgreSQL crash (postgres-crash) loses such commits although they returned:
                # orders, messages, the consumers' marks. Durable, as in production; with
                # fsync off the flush is a write, not a disk sync.
                conn.exec_driver_sql(f"ALTER DATABASE {database} SET synchronous_commit = on")
            admin.dispose()
            url = with_database(server_url, database)
        # connect_timeout: a failover URL's attempt on a node nobody answers is bounded.
        self.engine = create_engine(sqlalchemy_url(url), pool_pre_ping=True,
                                    connect_args={"connect_timeout": 3})
        migrate(self.engine)
        topic = f"order.submit.faults-{uuid.uuid4().hex[:6]}"
        self.pipeline = Pipeline(database_url=url, bootstrap=bootstrap,
                                 topic=topic, group=f"orders-{topic}",
                                 workdir=self.workdir / "logs")
        if self.net is not None:
            self.pipeline.routes = self.net.routes(url)
        if self.cluster is not None:
            self._create_cluster_topics(url, bootstrap)
        else:
            self.pipeline.create_topic()
        self.supplier = SupplierClient(self.pipeline.start_supplier(), timeout=5)
        for kind, name in self.topology.names():
            self.pipeline.start(kind, name)
        self.wait_ready()
        if self.probe is not None:
            self.probe.start()
        self._sampler = threading.Thread(target=self._sample_duplicates, daemon=True)
        self._sampler.start()

    def _start_proxied(self) -> tuple[str, str]:
        """PostgreSQL, Toxiproxy, its proxies and a broker with a listener per client kind;
        the direct URL and bootstrap (the harness's own: seeding and checks never go through
        a proxy)."""
        assert self.net is not None
        self.net.start()  # first: no Toxiproxy is an error naming its install command
        cluster = self.services.start_postgres()
        self.net.proxy_postgres(cluster.port)
        broker = self.net.start_broker(self.services.kafka_home)
        return cluster.dsn, broker.bootstrap

    def _create_cluster_topics(self, url: str, bootstrap: str) -> None:
        """The scenario topic replicated 3 times with min.insync.replicas 2 (what production
        runs), and the probe's topic the same way, stamped with the broker's append time."""
        assert self.cluster is not None
        k = self.cluster.k
        replicated = {"min.insync.replicas": "2"}
        k.create_topic(self.p.topic, partitions=PARTITIONS, replication_factor=3,
                       configs=replicated)
        self.probe = Probe(url, probe_topic(), bootstrap)
        k.create_topic(self.probe.topic, partitions=PROBE_PARTITIONS, replication_factor=3,
                       configs={**replicated, **TOPIC_CONFIGS})

    def stop(self) -> None:
        """Stops everything this harness started, even after a failed start."""
        self._sampling.set()
        try:
            if self.probe is not None:
                self.probe.stop()
            if self._sampler is not None:
                self._sampler.join(timeout=5)
            if self.pipeline is not None:
                self.pipeline.stop_all()
            if self.engine is not None:
                self.engine.dispose()
        finally:
            if self.net is not None:
                self.net.stop()
            if self.cluster is not None:
                self.cluster.down()
            else:
                self.services.down()

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        """Until every consumer answers /readyz: the first scenario then measures recovery,
        not start-up."""
        deadline = time.monotonic() + timeout_s
        for name in self.names("consumer"):
            while not self.p.ready(name):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not ready in {timeout_s:.0f} s: "
                                       f"{self.p.tail(name)}")
                time.sleep(0.2)

    # --- what scenarios use --------------------------------------------------------------
    @property
    def p(self) -> Pipeline:
        assert self.pipeline is not None
        return self.pipeline

    def seed_orders(self, scenario: str, items: list[str] | None = None,
                    accounts: int | None = None) -> list[uuid.UUID]:
        """Queue orders (*items*, or the harness's number of them) over *accounts* accounts,
        the message keys (default: the example's few)."""
        assert self.engine is not None
        items = items or [f"{scenario}-item-{i}" for i in range(self.orders)]
        batch = f"{scenario}-{self.seed}-{uuid.uuid4().hex[:4]}"
        if accounts is None:
            return agent.seed(self.engine, items, batch=batch)
        return agent.seed(self.engine, items, batch=batch, accounts=accounts)

    def names(self, kind: str) -> list[str]:
        return [n for n, p in self.p.procs.items() if p.kind == kind]

    def heal(self) -> list[str]:
        """Restart every process that died (without failpoints); return their names."""
        dead = [n for n in self.p.dead() if n != "supplier"]
        for name in dead:
            self.p.restart(name)
        self.restarted += dead
        return dead

    def wait_final(self, run_ids: list[uuid.UUID], timeout_s: float,
                   during: Callable[[], None] | None = None) -> bool:
        """Until every run is final, restarting whatever dies meanwhile."""
        assert self.engine is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if during is not None:
                during()
            self.heal()
            with self.engine.connect() as conn:
                left = conn.execute(text(
                    "SELECT count(*) FROM outboxkit.agent_runs WHERE id = ANY(:ids) "
                    "AND state NOT IN ('done', 'failed', 'needs-human')"),
                    {"ids": run_ids}).scalar_one()
                pending = conn.execute(text(
                    "SELECT count(*) FROM outboxkit.message_status WHERE run_id = ANY(:ids) "
                    "AND status <> 'published'"), {"ids": run_ids}).scalar_one()
            if left == 0 and pending == 0:
                return True
            time.sleep(0.5)
        return False

    def check(self, result: ScenarioResult, run_ids: list[uuid.UUID]) -> None:
        assert self.engine is not None
        assert self.supplier is not None
        result.findings = invariants.check(self.engine, bootstrap=self.p.bootstrap,
                                           topic=self.p.topic, supplier=self.supplier,
                                           run_ids=run_ids)
        result.duplicates_dropped = self.duplicates_dropped()

    # --- duplicates dropped, from the consumers' own counters ----------------------------
    def _scrape(self) -> None:
        for name in self.names("consumer"):
            value = self.p.metric(name, "outboxkit_consumer_duplicates_total")
            if value is not None:
                self._dup_seen[(name, self.p.procs[name].popen.pid)] = value

    def _sample_duplicates(self) -> None:
        while not self._sampling.wait(0.5):
            self._scrape()

    def duplicates_dropped(self) -> int:
        """Duplicates the consumers dropped, summed over every process incarnation (a killed
        consumer's last half second is not counted: a lower bound)."""
        self._scrape()
        return int(sum(self._dup_seen.values()))

    def report_kwargs(self) -> dict[str, Any]:
        return {"seed": self.seed, "topology": vars(self.topology)}

    @property
    def network(self) -> Network:
        """The proxies (a network scenario on a harness started with ``proxied=True``)."""
        if self.net is None:
            raise RuntimeError("a network scenario needs the proxied harness (--network)")
        return self.net
