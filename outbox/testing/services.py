"""Run a real PostgreSQL and a real Kafka broker as local processes, without Docker.

    python -m outbox.testing.services up       # start both (or reuse), print export lines
    python -m outbox.testing.services status
    python -m outbox.testing.services down     # stop both by their recorded pids
    python -m outbox.testing.services stop kafka / start kafka   # e.g. for outage tests

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
from outbox.testing import kafka, postgres
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

    def start_postgres(self, port: int | None = None) -> postgres.PostgresCluster:
        postgres_bin_dir()  # fail first, and clearly, when PostgreSQL is not installed
        self.state_dir.mkdir(parents=True, exist_ok=True)
        running = postgres.running_cluster(self.postgres_dir)
        if running:
            return running
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
    ) -> Endpoints:
        cluster = self.start_postgres(pg_port)
        broker = self.start_kafka(kafka_port, kafka_controller_port)
        return Endpoints(cluster.dsn, broker.bootstrap, cluster.pid, broker.pid)

    def stop_postgres(self) -> bool:
        return postgres.stop(self.postgres_dir)

    def stop_kafka(self) -> bool:
        return kafka.stop(self.kafka_home)

    def down(self) -> list[str]:
        stopped = []
        if self.stop_kafka():
            stopped.append("kafka")
        if self.stop_postgres():
            stopped.append("postgres")
        return stopped

    def status(self) -> dict[str, dict[str, object] | None]:
        cluster = postgres.running_cluster(self.postgres_dir)
        broker = kafka.running_broker(self.kafka_home)
        return {
            "postgres": {"pid": cluster.pid, "url": cluster.dsn} if cluster else None,
            "kafka": {"pid": broker.pid, "bootstrap": broker.bootstrap} if broker else None,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="outboxkit-services", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="state folder (default .services or OUTBOXKIT_SERVICES_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start PostgreSQL and Kafka, or reuse the running ones")
    up.add_argument("--pg-port", type=int)
    up.add_argument("--kafka-port", type=int)
    up.add_argument("--kafka-controller-port", type=int)
    sub.add_parser("down", help="stop both services (data is kept; delete the folder to wipe)")
    sub.add_parser("status", help="say what runs")
    for name in ("start", "stop"):
        one = sub.add_parser(name, help=f"{name} one service")
        one.add_argument("service", choices=["postgres", "kafka"])
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
        return 0 if all(status.values()) else 3
    elif args.command == "start":
        if args.service == "postgres":
            print(services.start_postgres().dsn)
        else:
            print(services.start_kafka().bootstrap)
    elif args.command == "stop":
        stopper = services.stop_postgres if args.service == "postgres" else services.stop_kafka
        print("stopped" if stopper() else "was not running", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
