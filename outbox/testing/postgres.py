"""A throwaway PostgreSQL cluster on loopback, made with initdb and run with pg_ctl.

PostgreSQL refuses to run as root, so when we are root the cluster is owned and run by
an unprivileged user (``postgres`` unless OUTBOXKIT_PG_USER says otherwise).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from outbox.errors import MissingToolError, ServiceError
from outbox.testing.processes import ensure_port_free, pid_alive, port_open, stop_pid
from outbox.testing.tools import postgres_bin_dir

# Test clusters trade durability for speed; benchmarks switch fsync back on (ALTER SYSTEM).
FAST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "256MB",
    "max_locks_per_transaction": "256",
}

# What a primary needs to feed a streaming standby (outbox.testing.pg_standby). These are
# PostgreSQL 10+'s defaults, written out so a site-wide config that lowers them cannot break
# the standby; initdb's pg_hba.conf already lets loopback connect for replication (trust).
REPLICATION_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "10",
    "max_replication_slots": "10",
    "hot_standby": "on",
}

MAX_PREPARED_TRANSACTIONS = 10


@dataclass(frozen=True)
class PostgresCluster:
    data_dir: Path
    port: int
    pid: int

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


def _runuser() -> str:
    for candidate in (shutil.which("runuser"), "/usr/sbin/runuser", "/sbin/runuser"):
        if candidate and Path(candidate).is_file():
            return candidate
    raise MissingToolError(
        "runuser (needed to run PostgreSQL as an unprivileged user while we are root)",
        "Install util-linux, or run as a non-root user.",
    )


def _run_as_owner(argv: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    if os.geteuid() == 0:
        argv = [_runuser(), "-u", _owner(), "--", *argv]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from exc


def _owner() -> str:
    user = os.environ.get("OUTBOXKIT_PG_USER", "postgres")
    try:
        pwd.getpwnam(user)
    except KeyError as exc:
        raise ServiceError(
            f"PostgreSQL cannot run as root and the user {user!r} does not exist; create it "
            f"(`useradd --system {user}`) or set OUTBOXKIT_PG_USER to an unprivileged user"
        ) from exc
    return user


def data_dir_for(state_dir: Path) -> Path:
    """Where the cluster lives: inside *state_dir*, unless the owner cannot reach it."""
    wanted = state_dir / "postgres"
    if os.geteuid() != 0:
        return wanted
    probe = subprocess.run(
        [_runuser(), "-u", _owner(), "--", "/usr/bin/test", "-x", str(state_dir)],
        capture_output=True,
        check=False,
    )
    if probe.returncode == 0:
        return wanted
    # e.g. a clone under /root: the postgres user cannot traverse it.
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"outboxkit-postgres-{digest}"


def running_cluster(data_dir: Path) -> PostgresCluster | None:
    """The cluster already running from *data_dir*, if any (read from postmaster.pid)."""
    pid_file = data_dir / "data" / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
    except (FileNotFoundError, PermissionError):
        return None
    if len(lines) < 4 or not lines[0].strip().isdigit():
        return None
    pid, port = int(lines[0]), int(lines[3])
    if pid_alive(pid) and port_open(port):
        return PostgresCluster(data_dir, port, pid)
    return None


def start(data_dir: Path, port: int) -> PostgresCluster:
    bin_dir = postgres_bin_dir()
    existing = running_cluster(data_dir)
    if existing:
        return existing
    ensure_port_free(port, "PostgreSQL", "--pg-port")
    data = data_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(data_dir, user=_owner())
    if not (data / "PG_VERSION").exists():
        shutil.rmtree(data, ignore_errors=True)
        result = _run_as_owner(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--auth-local=trust",
                "--auth-host=trust",
                "--no-sync",
            ],
            timeout=120,
        )
        if result.returncode != 0:
            raise ServiceError(f"initdb failed in {data}: {result.stderr.strip()[-2000:]}")
        settings = "\n".join(
            f"{k} = '{v}'" for k, v in {**FAST_SETTINGS, **REPLICATION_SETTINGS}.items()
        )
        with (data / "postgresql.conf").open("a") as conf:
            conf.write(f"\n# outboxkit test cluster\n{settings}\n")
    # Only loopback; the socket goes in our own folder, not the system's /run/postgresql.
    # Prepared transactions (0 by default: PREPARE TRANSACTION refused) for the two-phase
    # commit tests; an option of the start, not of initdb, so an existing cluster gets it at
    # its next start, and a standby (started here too) matches its primary, as it must.
    options = (
        f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={data_dir}"
        f" -c max_prepared_transactions={MAX_PREPARED_TRANSACTIONS}"
    )
    log = data_dir / "postgres.log"
    result = _run_as_owner(
        [
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data),
            "-o",
            options,
            "-l",
            str(log),
            "-w",
            "-t",
            "60",
            "start",
        ],
        timeout=90,
    )
    cluster = running_cluster(data_dir)
    if result.returncode != 0 or cluster is None:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise ServiceError(
            f"PostgreSQL did not start on port {port}: {result.stderr.strip()} {tail}".strip()
        )
    return cluster


def stop(data_dir: Path, *, grace_s: float = 20.0) -> bool:
    """Stop the cluster gracefully (fast shutdown); True if something was running."""
    cluster = running_cluster(data_dir)
    if cluster is None:
        return False
    # SIGINT is PostgreSQL's "fast" shutdown: roll back sessions, checkpoint, exit.
    os.kill(cluster.pid, 2)
    deadline = time.monotonic() + grace_s
    while pid_alive(cluster.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_pid(cluster.pid, grace_s=1.0)
    return True
