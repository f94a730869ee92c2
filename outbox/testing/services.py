"""Run a real PostgreSQL and a real Kafka broker as local processes, without Docker.

    python -m outbox.testing.services up       # start both (or reuse), print export lines
    python -m outbox.testing.services up --standby [--sync-standby]   # and a PostgreSQL standby
    python -m outbox.testing.services status
    python -m outbox.testing.services down     # stop both by their recorded pids
    python -m outbox.testing.services stop kafka / start kafka   # e.g. for outage tests
    python -m outbox.testing.services up --brokers 3   # Kafka as a 3-node KRaft cluster
    python -m outbox.testing.services stop kafka-node 2 [--kill] / start kafka-node 2

With ``--standby`` the database URL names both nodes with ``target_session_attrs=read-write``
(libpq keeps the one that accepts writes), so clients follow a failover: ``stop postgres``
then ``promote`` plays one.

With ``--brokers 3`` Kafka is a replicated cluster (:mod:`outbox.testing.kafka_cluster`:
3 combined broker+controller nodes, topics with 3 replicas and ``min.insync.replicas=2``)
in ``<state>/kafka-cluster``, and the exported bootstrap lists every node. The folder
remembers its mode, so ``status``, ``down`` and ``start``/``stop kafka`` act on the cluster
without the flag; a single broker and a cluster never run from one folder at once.

Everything lives in a state folder (default ``.services/``, or OUTBOXKIT_SERVICES_DIR).
``up`` prints human-readable lines on stderr and ``export`` lines on stdout, so
``eval "$(python -m outbox.testing.services up)"`` configures a shell.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from outbox.errors import ServiceError
from outbox.testing import kafka, kafka_cluster, pg_standby, postgres
from outbox.testing.processes import service_port
from outbox.testing.tools import postgres_bin_dir


@dataclass(frozen=True)
class Endpoints:
    database_url: str
    kafka_bootstrap: str
    postgres_pid: int
    kafka_pid: int
    """The single broker's, or the first running node's of a cluster."""
    kafka_pids: tuple[int, ...] = ()
    """Every Kafka node's (one for the single broker)."""

    def exports(self) -> str:
        lines = (
            f"export OUTBOXKIT_TEST_DATABASE_URL={self.database_url}\n"
            f"export OUTBOXKIT_TEST_KAFKA_BOOTSTRAP={self.kafka_bootstrap}\n"
            f"export OUTBOXKIT_DATABASE_URL={self.database_url}\n"
            f"export OUTBOXKIT_KAFKA_BOOTSTRAP={self.kafka_bootstrap}\n"
        )
        if len(self.kafka_pids) > 1:
            # The relay creates a missing topic with 1 replica unless told otherwise, and a
            # topic of 1 replica refuses acks=all under the cluster's min.insync.replicas=2.
            replicas = min(3, len(self.kafka_pids))
            lines += f"export OUTBOXKIT_RELAY_TOPIC_REPLICATION={replicas}\n"
        return lines


class LocalServices:
    """The PostgreSQL cluster and Kafka broker of one state folder."""

    def __init__(self, state_dir: Path | str | None = None) -> None:
        self.state_dir = Path(state_dir or os.environ.get("OUTBOXKIT_SERVICES_DIR") or ".services")
        self.state_dir = self.state_dir.resolve()
        self.kafka_home = self.state_dir / "kafka"
        self.kafka_cluster_home = self.state_dir / "kafka-cluster"
        self._ports_file = self.state_dir / "ports.json"
        self._mode_file = self.state_dir / "kafka-mode.json"

    @property
    def postgres_dir(self) -> Path:
        return postgres.data_dir_for(self.state_dir)

    def _ports(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads(self._ports_file.read_text()).items()}
        except (FileNotFoundError, ValueError):
            return {}

    def _remember(self, **ports: int) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._ports_file.write_text(json.dumps({**self._ports(), **ports}))

    @property
    def standby_dir(self) -> Path:
        """Beside the primary's (which moves out of a folder its owner cannot enter)."""
        primary = self.postgres_dir
        return primary.with_name(f"{primary.name}-standby")

    def start_standby(self, port: int | None = None, *,
                      synchronous: bool = False) -> postgres.PostgresCluster:
        """A streaming standby of this folder's PostgreSQL (started first if need be)."""
        primary = self.start_postgres()
        port = port or self._ports().get("postgres_standby") or service_port()
        standby = pg_standby.start_standby(self.postgres_dir, self.standby_dir, port=port,
                                           primary_port=primary.port, synchronous=synchronous)
        self._remember(postgres_standby=standby.port)
        return standby

    def database_url(self, cluster: postgres.PostgresCluster) -> str:
        """*cluster*'s URL, or both nodes' when a standby runs (the failover URL)."""
        standby = pg_standby.running_standby(self.standby_dir)
        if standby is None or standby.port == cluster.port:
            return cluster.dsn
        return pg_standby.failover_url(cluster, standby, cluster.dsn.rsplit("/", 1)[1])

    def start_postgres(self, port: int | None = None) -> postgres.PostgresCluster:
        postgres_bin_dir()  # fail first, and clearly, when PostgreSQL is not installed
        self.state_dir.mkdir(parents=True, exist_ok=True)
        running = postgres.running_cluster(self.postgres_dir)
        if running:
            return running
        if self.standby_dir.exists() and not pg_standby.is_standby(self.standby_dir):
            # The failover URL tries this node first: two nodes taking writes lose data.
            raise ServiceError(
                "the standby was promoted: starting the old primary again would make a second "
                f"node that takes writes; stop everything (`down`) and delete {self.state_dir} "
                "to start afresh")
        port = port or self._ports().get("postgres") or service_port()
        cluster = postgres.start(self.postgres_dir, port)
        self._remember(postgres=cluster.port)
        return cluster

    # --- Kafka: one broker, or a cluster ----------------------------------------------

    @property
    def kafka_brokers(self) -> int:
        """The folder's Kafka mode: 1 (the single broker) or a cluster's node count, as the
        last ``up``/``start`` recorded it, so later commands need no flag."""
        try:
            return int(json.loads(self._mode_file.read_text())["brokers"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 1

    def _set_mode(self, brokers: int) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._mode_file.write_text(json.dumps({"brokers": brokers}))

    def _check_mode(self, brokers: int) -> None:
        """Refuse to start one kind while the other runs from this folder: both would be
        "this folder's Kafka", and ``down``/``status`` could only ever see one of them."""
        if brokers == 1:
            running = kafka_cluster.running_cluster(self.kafka_cluster_home)
            if running is not None:
                raise ServiceError(
                    f"a {len(running.node_ids)}-node Kafka cluster runs from {self.state_dir}; "
                    f"use `up --brokers {len(running.node_ids)}` to reuse it, or stop it "
                    "(`down`) before starting the single broker")
        elif kafka.running_broker(self.kafka_home) is not None:
            raise ServiceError(
                f"the single Kafka broker runs from {self.state_dir}; stop it (`down`) "
                f"before starting a {brokers}-node cluster in this folder, or use another "
                "folder (--dir)")

    def start_kafka(
        self, port: int | None = None, controller_port: int | None = None
    ) -> kafka.KafkaBroker:
        """The single broker (started, or the running one)."""
        self._check_mode(1)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        running = kafka.running_broker(self.kafka_home)
        if running:
            self._set_mode(1)
            return running
        known = self._ports()
        port = port or known.get("kafka") or service_port()
        controller_port = controller_port or known.get("kafka_controller") or service_port()
        broker = kafka.start(self.kafka_home, port, controller_port)
        self._remember(kafka=broker.port, kafka_controller=broker.controller_port)
        self._set_mode(1)
        return broker

    def start_kafka_cluster(self, nodes: int = 3) -> kafka_cluster.KafkaCluster:
        """A cluster of *nodes* in ``kafka-cluster/`` (started, its stopped nodes started
        again, or the running one). Its ports and id are kept in its ``cluster.json``."""
        if nodes < 2:
            raise ServiceError(f"a cluster has 2 nodes or more, not {nodes}; "
                               "one broker is `up --brokers 1`")
        self._check_mode(nodes)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cluster = kafka_cluster.start_cluster(self.kafka_cluster_home, nodes=nodes)
        self._set_mode(nodes)
        return cluster

    def recorded_cluster(self) -> kafka_cluster.KafkaCluster:
        """This folder's cluster, running or not; an error saying what to do without one."""
        if self.kafka_brokers == 1:
            raise ServiceError(f"{self.state_dir} runs a single Kafka broker, not a cluster; "
                               "`down`, then `up --brokers 3`")
        return kafka_cluster.KafkaCluster(self.kafka_cluster_home)

    def start_kafka_node(self, node_id: int) -> kafka_cluster.KafkaNode:
        """Start one node of the cluster again (after ``stop_kafka_node``), on its ports and
        data; a paused node is restarted, a running one left as it is."""
        cluster = self.recorded_cluster()
        node = cluster.node(node_id)
        if node.pid is not None and not node.paused:
            return node
        others = [n for n in cluster.nodes if n.id != node_id and n.pid is not None]
        if len(others) + 1 <= len(cluster.node_ids) // 2:
            # Alone it could never elect a controller: waiting would only time out.
            raise ServiceError(
                f"too few other nodes of the Kafka cluster run for node {node_id} to join a "
                "quorum; `start kafka` starts the whole cluster")
        return cluster.restart(node_id)

    def stop_kafka_node(self, node_id: int, *, kill: bool = False) -> bool:
        """Stop one node: SIGTERM (a controlled shutdown, its leaderships move first), or
        with *kill* SIGKILL (a crash: the cluster finds out through missed heartbeats).
        False if it was not running."""
        cluster = self.recorded_cluster()
        if kill:
            if cluster.node(node_id).pid is None:
                return False
            cluster.kill(node_id)
            return True
        return cluster.stop_node(node_id)

    def up(
        self,
        *,
        pg_port: int | None = None,
        kafka_port: int | None = None,
        kafka_controller_port: int | None = None,
        standby: bool = False,
        sync_standby: bool = False,
        standby_port: int | None = None,
        brokers: int = 1,
    ) -> Endpoints:
        """Start (or reuse) PostgreSQL, its standby if asked, and Kafka: the single broker,
        or with ``brokers=3`` a 3-node cluster whose every node the bootstrap names."""
        if brokers > 1 and (kafka_port or kafka_controller_port):
            raise ServiceError("--kafka-port/--kafka-controller-port set the single broker's "
                               "ports; a cluster's are chosen free and kept in "
                               f"{self.kafka_cluster_home}/{kafka_cluster.CLUSTER_FILE}")
        self._check_mode(brokers)  # before starting anything else
        cluster = self.start_postgres(pg_port)
        if standby or sync_standby:
            self.start_standby(standby_port, synchronous=sync_standby)
        url = self.database_url(cluster)
        if brokers == 1:
            broker = self.start_kafka(kafka_port, kafka_controller_port)
            return Endpoints(url, broker.bootstrap, cluster.pid, broker.pid, (broker.pid,))
        nodes = self.start_kafka_cluster(brokers)
        pids = tuple(n.pid for n in nodes.nodes if n.pid is not None)
        return Endpoints(url, nodes.bootstrap, cluster.pid, pids[0], pids)

    def promote(self) -> postgres.PostgresCluster:
        """Promote the standby (after ``stop postgres``, a failover)."""
        return pg_standby.promote(self.standby_dir)

    def stop_postgres(self) -> bool:
        return postgres.stop(self.postgres_dir)

    def stop_kafka(self) -> bool:
        """Stop this folder's Kafka, the single broker or every node of the cluster, by pid.
        True if something was running."""
        single = kafka.stop(self.kafka_home)
        return bool(kafka_cluster.stop_cluster(self.kafka_cluster_home)) or single

    def start_kafka_in_mode(self) -> str:
        """``start kafka``: the folder's Kafka as it was last started; its bootstrap."""
        brokers = self.kafka_brokers
        if brokers == 1:
            return self.start_kafka().bootstrap
        return self.start_kafka_cluster(brokers).bootstrap

    def stop_standby(self) -> bool:
        return pg_standby.stop_standby(self.standby_dir)

    def down(self) -> list[str]:
        """Stop everything of this folder by its recorded pid: the single broker or every
        cluster node, the standby, the primary. Data is kept."""
        stopped = []
        if kafka.stop(self.kafka_home):
            stopped.append("kafka")
        if nodes := kafka_cluster.stop_cluster(self.kafka_cluster_home):
            stopped.append(f"kafka nodes {', '.join(str(n) for n in nodes)}")
        if self.stop_standby():
            stopped.append("postgres standby")
        if self.stop_postgres():
            stopped.append("postgres")
        return stopped

    def status(self) -> dict[str, dict[str, object] | None]:
        """What runs: ``postgres``, ``kafka`` (None when not running) and, when there are,
        the standby and each cluster node (``kafka node <id>``, with its state)."""
        cluster = postgres.running_cluster(self.postgres_dir)
        status: dict[str, dict[str, object] | None] = {
            "postgres": {"pid": cluster.pid, "url": cluster.dsn} if cluster else None,
        }
        if self.kafka_brokers == 1:
            broker = kafka.running_broker(self.kafka_home)
            status["kafka"] = {"pid": broker.pid, "bootstrap": broker.bootstrap} if broker else None
        else:
            status.update(self._cluster_status())
        if self.standby_dir.exists():
            standby = pg_standby.running_standby(self.standby_dir)
            role = "standby" if pg_standby.is_standby(self.standby_dir) else "promoted"
            status["postgres standby"] = (
                {"pid": standby.pid, "url": standby.dsn, "role": role} if standby else None)
        return status

    def _cluster_status(self) -> dict[str, dict[str, object] | None]:
        running = kafka_cluster.running_cluster(self.kafka_cluster_home)
        if running is None:
            return {"kafka": None}
        controller = running.active_controller()
        found: dict[str, dict[str, object] | None] = {
            "kafka": {"bootstrap": running.bootstrap, "nodes": len(running.node_ids),
                      "controller": controller if controller >= 0 else None},
        }
        for node in running.nodes:
            state = "not running" if node.pid is None else "paused" if node.paused else "alive"
            found[f"kafka node {node.id}"] = {
                "pid": node.pid, "port": node.port, "state": state,
                "controller": node.id == controller,
            }
        return found


def everything_runs(status: dict[str, dict[str, object] | None]) -> bool:
    """``status``'s exit code 0: every service asked for runs, every cluster node alive."""
    return all(
        info is not None and info.get("state", "alive") == "alive" for info in status.values()
    )


class _ServicesGroup(click.Group):
    """A :class:`ServiceError` is one ``error: ...`` line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ServiceError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


@click.group(cls=_ServicesGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dir", "state_dir",
              help="state folder (default .services or OUTBOXKIT_SERVICES_DIR)")
@click.pass_context
def services_command(ctx: click.Context, state_dir: str | None) -> None:
    """Run a real PostgreSQL and a real Kafka broker as local processes, without Docker."""
    ctx.obj = LocalServices(state_dir)


@services_command.command("up")
@click.option("--pg-port", type=int)
@click.option("--kafka-port", type=int)
@click.option("--kafka-controller-port", type=int)
@click.option("--standby", is_flag=True,
              help="also a streaming standby of PostgreSQL (a replication slot)")
@click.option("--sync-standby", is_flag=True,
              help="the standby, synchronous: a commit returns once the standby has it")
@click.option("--standby-port", type=int)
@click.option("--brokers", type=int, default=1,
              help="Kafka nodes: 1, the single broker (default), or 3, a replicated KRaft "
                   "cluster (replication factor 3, min.insync.replicas=2)")
@click.pass_obj
def up_command(services: LocalServices, *, pg_port: int | None, kafka_port: int | None,
               kafka_controller_port: int | None, standby: bool, sync_standby: bool,
               standby_port: int | None, brokers: int) -> None:
    """Start PostgreSQL and Kafka, or reuse the running ones; print their export lines."""
    started = time.monotonic()
    endpoints = services.up(
        pg_port=pg_port,
        kafka_port=kafka_port,
        kafka_controller_port=kafka_controller_port,
        standby=standby,
        sync_standby=sync_standby,
        standby_port=standby_port,
        brokers=brokers,
    )
    pids = ", ".join(str(p) for p in endpoints.kafka_pids)
    plural = "s" if len(endpoints.kafka_pids) > 1 else ""
    click.echo(
        f"PostgreSQL  {endpoints.database_url}  (pid {endpoints.postgres_pid})\n"
        f"Kafka       {endpoints.kafka_bootstrap}  (pid{plural} {pids})\n"
        f"ready in {time.monotonic() - started:.1f} s; state in {services.state_dir}",
        err=True,
    )
    click.echo(endpoints.exports(), nl=False)


@services_command.command("down")
@click.pass_obj
def down_command(services: LocalServices) -> None:
    """Stop both services (data is kept; delete the folder to wipe)."""
    stopped = services.down()
    click.echo(f"stopped: {', '.join(stopped) or 'nothing was running'}", err=True)


@services_command.command("status")
@click.pass_context
def status_command(ctx: click.Context) -> None:
    """Say what runs (exit status 3 unless everything does)."""
    services: LocalServices = ctx.obj
    status = services.status()
    width = max(9, *(len(name) for name in status))
    for name, info in status.items():
        click.echo(f"{name:<{width}} {json.dumps(info) if info else 'not running'}")
    ctx.exit(0 if everything_runs(status) else 3)


SERVICE = click.Choice(["postgres", "kafka", "standby", "kafka-node"])


@services_command.command("start")
@click.argument("service", type=SERVICE, metavar="SERVICE")
@click.argument("node", type=int, required=False)
@click.pass_obj
def start_command(services: LocalServices, service: str, node: int | None) -> None:
    """Start one SERVICE: postgres, kafka, standby, or kafka-node NODE (its id, 1-3)."""
    _one_node(service, node)
    if service == "postgres":
        click.echo(services.start_postgres().dsn)
    elif service == "standby":
        click.echo(services.start_standby().dsn)
    elif service == "kafka-node":
        assert node is not None
        click.echo(services.start_kafka_node(node).bootstrap)
    else:
        click.echo(services.start_kafka_in_mode())


@services_command.command("stop")
@click.argument("service", type=SERVICE, metavar="SERVICE")
@click.argument("node", type=int, required=False)
@click.option("--kill", is_flag=True, help="kafka-node: SIGKILL (a crash), not a clean stop")
@click.pass_obj
def stop_command(services: LocalServices, service: str, node: int | None, kill: bool) -> None:
    """Stop one SERVICE: postgres, kafka, standby, or kafka-node NODE (its id, 1-3)."""
    _one_node(service, node)
    if service == "kafka-node":
        assert node is not None
        stopped = services.stop_kafka_node(node, kill=kill)
    else:
        stopped = {"postgres": services.stop_postgres, "kafka": services.stop_kafka,
                   "standby": services.stop_standby}[service]()
    click.echo("stopped" if stopped else "was not running", err=True)


@services_command.command("promote")
@click.pass_obj
def promote_command(services: LocalServices) -> None:
    """Promote the standby (after `stop postgres`: a failover)."""
    promoted = services.promote()
    click.echo(f"promoted: {promoted.dsn} accepts writes", err=True)


def _one_node(service: str, node: int | None) -> None:
    if (service == "kafka-node") != (node is not None):
        raise ServiceError("a node id goes with kafka-node and only with it: "
                           "`stop kafka-node 2`, `start kafka-node 2`")


def main(argv: list[str] | None = None) -> int:
    """``outboxkit-services`` and ``python -m outbox.testing.services``: run the command,
    return its exit status (0 done, 1 a service failed, 2 bad usage, 3 ``status``: not
    everything runs)."""
    try:
        services_command.main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
