"""Run a real PostgreSQL and a real Kafka broker as local processes, without Docker.

    python -m outbox.testing.services up       # start both (or reuse), print export lines
    python -m outbox.testing.services up --standby [--sync-standby]   # and a PostgreSQL standby
    python -m outbox.testing.services status
    python -m outbox.testing.services down     # stop both by their recorded pids
    python -m outbox.testing.services stop kafka / start kafka   # e.g. for outage tests

With ``--standby`` the database URL names both nodes with ``target_session_attrs=read-write``
(libpq keeps the one that accepts writes), so clients follow a failover: ``stop postgres``
then ``promote`` plays one.

Everything lives in a state folder (default ``.services/``, or OUTBOXKIT_SERVICES_DIR).
``up`` prints human-readable lines on stderr and ``export`` lines on stdout, so
``eval "$(python -m outbox.testing.services up)"`` configures a shell.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from outbox.errors import ServiceError
from outbox.testing import kafka, pg_standby, postgres
from outbox.testing.processes import free_port
from outbox.testing.tools import postgres_bin_dir


@dataclass(frozen=True)
class Endpoints:
    database_url: str
    kafka_bootstrap: str
    postgres_pid: int
    kafka_pid: int

    def exports(self) -> str:
        return (
            f"export OUTBOXKIT_TEST_DATABASE_URL={self.database_url}\n"
            f"export OUTBOXKIT_TEST_KAFKA_BOOTSTRAP={self.kafka_bootstrap}\n"
            f"export OUTBOXKIT_DATABASE_URL={self.database_url}\n"
            f"export OUTBOXKIT_KAFKA_BOOTSTRAP={self.kafka_bootstrap}\n"
        )


class LocalServices:
    """The PostgreSQL cluster and Kafka broker of one state folder."""

    def __init__(self, state_dir: Path | str | None = None) -> None:
        self.state_dir = Path(state_dir or os.environ.get("OUTBOXKIT_SERVICES_DIR") or ".services")
        self.state_dir = self.state_dir.resolve()
        self.kafka_home = self.state_dir / "kafka"
        self._ports_file = self.state_dir / "ports.json"

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
        port = port or self._ports().get("postgres_standby") or free_port()
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
        port = port or self._ports().get("postgres") or free_port()
        cluster = postgres.start(self.postgres_dir, port)
        self._remember(postgres=cluster.port)
        return cluster

    def start_kafka(
        self, port: int | None = None, controller_port: int | None = None
    ) -> kafka.KafkaBroker:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        running = kafka.running_broker(self.kafka_home)
        if running:
            return running
        known = self._ports()
        port = port or known.get("kafka") or free_port()
        controller_port = controller_port or known.get("kafka_controller") or free_port()
        broker = kafka.start(self.kafka_home, port, controller_port)
        self._remember(kafka=broker.port, kafka_controller=broker.controller_port)
        return broker

    def up(
        self,
        *,
        pg_port: int | None = None,
        kafka_port: int | None = None,
        kafka_controller_port: int | None = None,
        standby: bool = False,
        sync_standby: bool = False,
        standby_port: int | None = None,
    ) -> Endpoints:
        cluster = self.start_postgres(pg_port)
        if standby or sync_standby:
            self.start_standby(standby_port, synchronous=sync_standby)
        broker = self.start_kafka(kafka_port, kafka_controller_port)
        return Endpoints(self.database_url(cluster), broker.bootstrap, cluster.pid, broker.pid)

    def promote(self) -> postgres.PostgresCluster:
        """Promote the standby (after ``stop postgres``, a failover)."""
        return pg_standby.promote(self.standby_dir)

    def stop_postgres(self) -> bool:
        return postgres.stop(self.postgres_dir)

    def stop_kafka(self) -> bool:
        return kafka.stop(self.kafka_home)

    def stop_standby(self) -> bool:
        return pg_standby.stop_standby(self.standby_dir)

    def down(self) -> list[str]:
        stopped = []
        if self.stop_kafka():
            stopped.append("kafka")
        if self.stop_standby():
            stopped.append("postgres standby")
        if self.stop_postgres():
            stopped.append("postgres")
        return stopped

    def status(self) -> dict[str, dict[str, object] | None]:
        cluster = postgres.running_cluster(self.postgres_dir)
        broker = kafka.running_broker(self.kafka_home)
        status: dict[str, dict[str, object] | None] = {
            "postgres": {"pid": cluster.pid, "url": cluster.dsn} if cluster else None,
            "kafka": {"pid": broker.pid, "bootstrap": broker.bootstrap} if broker else None,
        }
        if self.standby_dir.exists():
            standby = pg_standby.running_standby(self.standby_dir)
            role = "standby" if pg_standby.is_standby(self.standby_dir) else "promoted"
            status["postgres standby"] = (
                {"pid": standby.pid, "url": standby.dsn, "role": role} if standby else None)
        return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="outboxkit-services", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="state folder (default .services or OUTBOXKIT_SERVICES_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start PostgreSQL and Kafka, or reuse the running ones")
    up.add_argument("--pg-port", type=int)
    up.add_argument("--kafka-port", type=int)
    up.add_argument("--kafka-controller-port", type=int)
    up.add_argument("--standby", action="store_true",
                    help="also a streaming standby of PostgreSQL (a replication slot)")
    up.add_argument("--sync-standby", action="store_true",
                    help="the standby, synchronous: a commit returns once the standby has it")
    up.add_argument("--standby-port", type=int)
    sub.add_parser("down", help="stop both services (data is kept; delete the folder to wipe)")
    sub.add_parser("status", help="say what runs")
    for name in ("start", "stop"):
        one = sub.add_parser(name, help=f"{name} one service")
        one.add_argument("service", choices=["postgres", "kafka", "standby"])
    sub.add_parser("promote", help="promote the standby (after `stop postgres`: a failover)")
    args = parser.parse_args(argv)
    services = LocalServices(args.dir)
    try:
        return _dispatch(services, args)
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _dispatch(services: LocalServices, args: argparse.Namespace) -> int:
    if args.command == "up":
        started = time.monotonic()
        endpoints = services.up(
            pg_port=args.pg_port,
            kafka_port=args.kafka_port,
            kafka_controller_port=args.kafka_controller_port,
            standby=args.standby,
            sync_standby=args.sync_standby,
            standby_port=args.standby_port,
        )
        print(
            f"PostgreSQL  {endpoints.database_url}  (pid {endpoints.postgres_pid})\n"
            f"Kafka       {endpoints.kafka_bootstrap}  (pid {endpoints.kafka_pid})\n"
            f"ready in {time.monotonic() - started:.1f} s; state in {services.state_dir}",
            file=sys.stderr,
        )
        sys.stdout.write(endpoints.exports())
    elif args.command == "down":
        stopped = services.down()
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}", file=sys.stderr)
    elif args.command == "status":
        status = services.status()
        for name, info in status.items():
            print(f"{name:<9} {json.dumps(info) if info else 'not running'}")
        return 0 if status["postgres"] and status["kafka"] else 3
    elif args.command == "start":
        if args.service == "postgres":
            print(services.start_postgres().dsn)
        elif args.service == "standby":
            print(services.start_standby().dsn)
        else:
            print(services.start_kafka().bootstrap)
    elif args.command == "stop":
        stopper = {"postgres": services.stop_postgres, "kafka": services.stop_kafka,
                   "standby": services.stop_standby}[args.service]
        print("stopped" if stopper() else "was not running", file=sys.stderr)
    elif args.command == "promote":
        promoted = services.promote()
        print(f"promoted: {promoted.dsn} accepts writes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
