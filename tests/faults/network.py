"""The fault harness's network: every process reaches PostgreSQL and Kafka only through
Toxiproxy proxies of its own, so a scenario can cut, slow or hang one path (the relays ↔ the
brokers, or one relay ↔ PostgreSQL) and leave the others (the consumers ↔ the brokers) alone.

PostgreSQL: a proxy per process (``pg-relay-1``, ``pg-agent-2``, ...), each forwarding to the
server's port. A scenario acts on a kind through all of its processes' proxies.

Kafka: a client learns the brokers' addresses from the metadata of the listener it connected
to, and then connects to those. So the harness's broker has one listener per Kafka client
process (``RELAY_1``, ``CONSUMER_2``, ...), each on a port of its own and advertised as that
process's proxy (``kafka-relay-1``): every connection of relay-1 goes through
``kafka-relay-1``, the bootstrap and every later one. The ``PLAINTEXT`` listener
(inter-broker, the harness's own admin, seeding and checks) and the controller's stay direct.

Only the processes of the harness's topology get proxies; one a scenario adds (scale-out)
reaches the services directly.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from outbox.testing import kafka
from outbox.testing.processes import service_port
from outbox.testing.toxiproxy import Client, Server, via

KAFKA_KINDS = ("relay", "consumer")  # agents and the reconciler never talk to Kafka


def pg_proxy(name: str) -> str:
    return f"pg-{name}"


def kafka_proxy(name: str) -> str:
    return f"kafka-{name}"


def _listener(name: str) -> str:
    return name.upper().replace("-", "_")


class Network:
    """The Toxiproxy server, its proxies and the broker whose listeners they front."""

    def __init__(self, workdir: Path, names: list[tuple[str, str]]) -> None:
        self.server = Server(workdir / "toxiproxy")
        self.names = names  # (kind, process name) of every proxied process
        self._api: Client | None = None
        self.addresses: dict[str, str] = {}  # proxy name → 127.0.0.1:port to connect to
        self.broker: kafka.KafkaBroker | None = None

    @property
    def api(self) -> Client:
        if self._api is None:
            raise RuntimeError("the network is not started")
        return self._api

    def start(self) -> None:
        self._api = self.server.start()

    def of(self, kind: str) -> list[str]:
        """The process names of *kind*."""
        return [n for k, n in self.names if k == kind]

    def _kafka_clients(self) -> list[str]:
        return [n for k, n in self.names if k in KAFKA_KINDS]

    def proxy_postgres(self, pg_port: int) -> None:
        for _, name in self.names:
            proxy = self.api.create(pg_proxy(name), f"127.0.0.1:{pg_port}")
            self.addresses[proxy.name] = proxy.address

    def start_broker(self, home: Path, *, ready_timeout_s: float = 90) -> kafka.KafkaBroker:
        """A single Kafka broker in *home* (where LocalServices keeps its own, so that
        ``down()`` stops it by its pid) with a listener per client process behind its proxy."""
        port, controller_port = service_port(), service_port()
        clients = self._kafka_clients()
        real = {name: service_port() for name in clients}
        for name in clients:  # the proxies first: the broker advertises their ports
            proxy = self.api.create(kafka_proxy(name), f"127.0.0.1:{real[name]}")
            self.addresses[proxy.name] = proxy.address
        listeners = [f"{_listener(n)}://127.0.0.1:{real[n]}" for n in clients]
        advertised = [f"{_listener(n)}://{self.addresses[kafka_proxy(n)]}" for n in clients]
        names = ["CONTROLLER", "PLAINTEXT", *(_listener(n) for n in clients)]
        settings = {
            "listeners": ",".join([f"PLAINTEXT://127.0.0.1:{port}",
                                   f"CONTROLLER://127.0.0.1:{controller_port}", *listeners]),
            "advertised.listeners": ",".join([f"PLAINTEXT://127.0.0.1:{port}", *advertised]),
            "listener.security.protocol.map": ",".join(f"{n}:PLAINTEXT" for n in names),
        }
        libs = kafka.ensure_jars()
        shutil.rmtree(home, ignore_errors=True)  # a fresh broker: its listeners are new
        home.mkdir(parents=True)
        config = kafka._write_config(home, port, controller_port, settings=settings)
        kafka.format_storage(home, libs, config, kafka._cluster_id(), standalone=True)
        proc = kafka.launch(home, libs, config, port, controller_port)
        broker = kafka.KafkaBroker(home, port, controller_port, proc.pid)
        try:
            kafka.wait_ready(broker, timeout_s=ready_timeout_s)
        except Exception:
            kafka.abandon(home, proc)
            raise
        self.broker = broker
        return broker

    def routes(self, database_url: str) -> dict[str, dict[str, str]]:
        """Per process name, the environment that points it at its proxies."""
        env: dict[str, dict[str, str]] = {}
        for _, name in self.names:
            env[name] = {"OUTBOXKIT_DATABASE_URL":
                         via(database_url, self.addresses[pg_proxy(name)])}
        for name in self._kafka_clients():
            env[name]["OUTBOXKIT_KAFKA_BOOTSTRAP"] = self.addresses[kafka_proxy(name)]
        return env

    def heal(self) -> None:
        """Every proxy enabled, every toxic gone."""
        self.api.reset()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop()
