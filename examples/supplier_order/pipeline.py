"""Starts, kills and restarts the example's processes, each a separate OS process.

Only processes this object started are ever signalled, by their pid. Every process writes
its output to ``<workdir>/<name>.log``.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kafka.admin import KafkaAdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[2]

# How each kind of process is started (after the interpreter).
COMMANDS = {
    "agent": ["-m", "examples.supplier_order.agent", "--worker", "{name}"],
    "relay": ["-m", "relay"],
    "consumer": ["-m", "consumers", "examples.supplier_order.consumer:app"],
    "reconciler": ["-m", "examples.supplier_order.reconciler"],
    "supplier": [str(ROOT / "examples" / "supplier.py"), "--port", "{port}"],
}
PARTITIONS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    kind: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    port: int | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class Pipeline:
    """The processes of one run of the example, sharing one database, broker and topic."""

    def __init__(self, *, database_url: str, bootstrap: str, topic: str, group: str,
                 workdir: Path, quiet: bool = True,
                 commands: Mapping[str, list[str]] = COMMANDS) -> None:
        self.database_url, self.bootstrap = database_url, bootstrap
        self.commands = commands  # another example's processes (examples/saga)
        self.topic, self.group, self.workdir = topic, group, workdir
        self.quiet = quiet
        self.supplier_url = ""
        self.procs: dict[str, Proc] = {}
        # Extra environment per process kind (a fault scenario's settings), kept by restarts.
        self.overrides: dict[str, dict[str, str]] = {}
        # Per process name, where it finds the services instead of database_url / bootstrap
        # (the fault harness's proxies); under the overrides, and kept by restarts.
        self.routes: dict[str, dict[str, str]] = {}
        self.deaths: list[tuple[str, int]] = []  # (name, exit code) of every process gone
        workdir.mkdir(parents=True, exist_ok=True)

    # --- setting up ----------------------------------------------------------------------
    def create_topic(self) -> None:
        """Create the topic up front: consumers then join with every partition known."""
        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="example-setup")
        try:
            if self.topic not in admin.list_topics():
                admin.create_topics([NewTopic(self.topic, PARTITIONS, 1)])
        finally:
            admin.close()

    def start_supplier(self) -> str:
        port = free_port()
        self.start("supplier", "supplier", port=port)
        self.supplier_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return self.supplier_url
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"the supplier did not listen on port {port}: {self.tail('supplier')}")

    def env(self, kind: str, name: str, failpoints: str | None,
            metrics_port: int | None) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])),
            "OUTBOXKIT_DATABASE_URL": self.database_url,
            "OUTBOXKIT_KAFKA_BOOTSTRAP": self.bootstrap,
            "OUTBOXKIT_EXAMPLE_TOPIC": self.topic,
            "OUTBOXKIT_EXAMPLE_GROUP": self.group,
            "OUTBOXKIT_EXAMPLE_SUPPLIER_URL": self.supplier_url,
        }
        env.pop("OUTBOXKIT_FAILPOINTS", None)
        if failpoints:
            env["OUTBOXKIT_FAILPOINTS"] = failpoints
        # A database that stops answering is given up on after 10 s (the daemons' default is
        # 60): within the half-open scenarios' hold, and long above any statement here.
        env.update(OUTBOXKIT_RELAY_DATABASE_ANSWER_TIMEOUT_SECONDS="10",
                   OUTBOXKIT_CONSUMER_DATABASE_ANSWER_TIMEOUT_SECONDS="10",
                   OUTBOXKIT_WORKER_DATABASE_ANSWER_TIMEOUT_SECONDS="10")
        if kind == "relay":
            env.update(OUTBOXKIT_RELAY_RELAY_ID=name, OUTBOXKIT_RELAY_LANE_LEASE_SECONDS="3",
                       OUTBOXKIT_RELAY_POLL_INTERVAL_SECONDS="0.5",
                       OUTBOXKIT_RELAY_BACKOFF_MAX_SECONDS="2",
                       OUTBOXKIT_RELAY_DELIVERY_TIMEOUT_MS="300000")
        if kind == "consumer":
            env.update(OUTBOXKIT_CONSUMER_MODE="per-message", OUTBOXKIT_CONSUMER_MAX_ATTEMPTS="100",
                       OUTBOXKIT_CONSUMER_MAX_POLL_INTERVAL_MS="900000",
                       OUTBOXKIT_CONSUMER_BACKOFF_MAX_SECONDS="2",
                       OUTBOXKIT_CONSUMER_SESSION_TIMEOUT_MS="6000")
            if metrics_port:
                env["OUTBOXKIT_CONSUMER_HTTP_PORT"] = str(metrics_port)
        env.update(self.routes.get(name, {}))
        env.update(self.overrides.get(kind, {}))
        return env

    # --- processes -----------------------------------------------------------------------
    def start(self, kind: str, name: str, *, failpoints: str | None = None,
              port: int | None = None) -> Proc:
        old = self.procs.get(name)
        if old is not None and old.alive:
            raise RuntimeError(f"{name} is already running (pid {old.popen.pid})")
        if kind == "consumer" and port is None:
            port = free_port()
        argv = [sys.executable, *(a.format(name=name, port=port) for a in self.commands[kind])]
        log = (self.workdir / f"{name}.log").open("ab")
        popen = subprocess.Popen(argv, env=self.env(kind, name, failpoints, port), cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        proc = Proc(name, kind, popen, log, port)
        self.procs[name] = proc
        return proc

    def restart(self, name: str, *, failpoints: str | None = None) -> Proc:
        proc = self.procs[name]
        if proc.alive:
            self.kill(name)
        self.reap(name)
        return self.start(proc.kind, name, failpoints=failpoints, port=proc.port)

    def kill(self, name: str) -> None:
        """SIGKILL: no cleanup, like a power cut."""
        proc = self.procs[name]
        if proc.alive:
            proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(timeout=30)

    def stop(self, name: str, timeout: float = 30.0) -> int:
        """SIGTERM, and SIGKILL if it has not exited within *timeout*."""
        proc = self.procs[name]
        if proc.alive:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.popen.send_signal(signal.SIGKILL)
                proc.popen.wait(timeout=30)
        return int(proc.popen.returncode)

    def reap(self, name: str) -> None:
        proc = self.procs[name]
        if not proc.alive and not proc.log.closed:
            self.deaths.append((name, int(proc.popen.returncode)))
            proc.log.close()

    def dead(self) -> list[str]:
        """Names of processes that exited (by a failpoint's kill, a crash or a signal)."""
        return [n for n, p in self.procs.items() if not p.alive]

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name, timeout=20)
            self.reap(name)

    def _get(self, name: str, path: str) -> tuple[int, str] | None:
        """GET *path* from consumer *name*'s HTTP port; None if it does not answer."""
        proc = self.procs.get(name)
        if proc is None or not proc.alive or proc.port is None:
            return None
        try:
            url = f"http://127.0.0.1:{proc.port}{path}"
            with urllib.request.urlopen(url, timeout=1) as response:
                return int(response.status), response.read().decode()
        except (OSError, http.client.HTTPException):  # also killed halfway through answering
            return None

    def metric(self, name: str, metric: str) -> float | None:
        """A counter or gauge from consumer *name*'s /metrics, or None if it does not answer."""
        got = self._get(name, "/metrics")
        for line in (got[1] if got else "").splitlines():
            if line.startswith(metric + " ") or line.startswith(metric + "{"):
                return float(line.split()[-1])
        return None

    def ready(self, name: str) -> bool:
        """Whether consumer *name* answers /readyz with 200."""
        got = self._get(name, "/readyz")
        return got is not None and got[0] == 200

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
