"""A streaming-replication standby of a throwaway primary (outbox.testing.postgres), to fail over.

The standby is a pg_basebackup copy of the primary's data folder (``-R`` writes its
standby.signal and primary_conninfo), fed through a physical replication slot so the primary
keeps every WAL segment the standby has not received yet, even while the standby is down.
Its walreceiver connects with ``application_name`` = the slot's name: that is the name
``synchronous_standby_names`` lists when the standby is synchronous.

Like the primary, the standby runs as the unprivileged owner when we are root, from its own
folder, on 127.0.0.1 only; it is stopped by the pid in its postmaster.pid.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import psycopg

from outbox.errors import ServiceError
from outbox.testing import postgres
from outbox.testing.postgres import PostgresCluster, _owner, _run_as_owner
from outbox.testing.processes import ensure_port_free
from outbox.testing.tools import postgres_bin_dir

DEFAULT_SLOT = "outboxkit_standby"


def _connect(port: int, dbname: str = "postgres") -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        host="127.0.0.1", port=port, user="postgres", dbname=dbname, autocommit=True,
        connect_timeout=5,
    )


def _ensure_slot(primary_port: int, slot: str) -> None:
    """Create the physical slot, reserving WAL now, unless an earlier standby left it."""
    with _connect(primary_port) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        if not exists:
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))


def _base_backup(standby_data_dir: Path, primary_port: int, slot: str) -> None:
    data = standby_data_dir / "data"
    shutil.rmtree(data, ignore_errors=True)
    standby_data_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(standby_data_dir, user=_owner())
    result = _run_as_owner(
        [
            str(postgres_bin_dir() / "pg_basebackup"),
            "-D", str(data),
            "-h", "127.0.0.1",
            "-p", str(primary_port),
            "-U", "postgres",
            "-X", "stream",
            "-S", slot,
            "-R",
            "--checkpoint=fast",
            "--no-sync",
        ],
        timeout=120,
    )
    if result.returncode != 0:
        shutil.rmtree(data, ignore_errors=True)
        raise ServiceError(
            f"pg_basebackup from the primary on port {primary_port} into {data} failed: "
            f"{result.stderr.strip()[-2000:]}; check that the primary runs and allows "
            "replication connections from 127.0.0.1 (pg_hba.conf)"
        )
    # Later lines of postgresql.auto.conf win over -R's: name the walreceiver after the slot
    # (what synchronous_standby_names matches), and never inherit the primary's synchronous
    # standby list: once promoted, this node has no standby and its commits must not wait.
    conninfo = (
        f"host=127.0.0.1 port={primary_port} user=postgres application_name={slot} "
        "connect_timeout=5"
    )
    with (data / "postgresql.auto.conf").open("a") as conf:
        conf.write(
            f"\n# outboxkit standby\nprimary_conninfo = '{conninfo}'\n"
            f"primary_slot_name = '{slot}'\nsynchronous_standby_names = ''\n"
            "wal_retrieve_retry_interval = '250ms'\n"
        )


def _replication_state(primary_port: int, slot: str) -> tuple[str, str] | None:
    with _connect(primary_port) as conn:
        row = conn.execute(
            "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
            (slot,),
        ).fetchone()
    return (str(row[0]), str(row[1])) if row else None


def wait_streaming(
    primary_port: int, slot: str = DEFAULT_SLOT, *, synchronous: bool = False,
    timeout_s: float = 30.0,
) -> None:
    """Until the primary streams to the standby (and counts it as synchronous, if asked)."""
    wanted = ("streaming", "sync") if synchronous else None
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        state = _replication_state(primary_port, slot)
        if state and (state == wanted or (wanted is None and state[0] == "streaming")):
            return
        time.sleep(0.1)
    raise ServiceError(
        f"the standby {slot!r} is not {'a synchronous ' if synchronous else ''}streaming "
        f"replica of the primary on port {primary_port} after {timeout_s:.0f} s (state: "
        f"{state}); see postgres.log in the standby's folder"
    )


def set_synchronous(primary_port: int, slot: str | None) -> None:
    """Make the primary's commits wait for the standby *slot* (None: wait for nobody).

    Only sessions with synchronous_commit on (or remote_apply…) wait: the throwaway
    clusters default to off for speed, so a test that wants the guarantee sets it.
    """
    names = f'"{slot}"' if slot else ""
    with _connect(primary_port) as conn:
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        conn.execute("SELECT pg_reload_conf()")


def running_standby(standby_data_dir: Path) -> PostgresCluster | None:
    """The node running from *standby_data_dir*, if any (still a standby or promoted)."""
    return postgres.running_cluster(standby_data_dir)


def is_standby(standby_data_dir: Path) -> bool:
    """True until promotion removes standby.signal."""
    return (standby_data_dir / "data" / "standby.signal").exists()


def start_standby(
    primary_data_dir: Path,
    standby_data_dir: Path,
    *,
    port: int,
    primary_port: int,
    synchronous: bool = False,
    slot: str = DEFAULT_SLOT,
) -> PostgresCluster:
    """Start (or reuse, or restart from its folder) a streaming standby of the primary.

    A new standby is cloned with pg_basebackup through replication slot *slot*; one whose
    folder is already there is just started again and catches up from the slot. Returns once
    the primary streams to it; with *synchronous*, once the primary's commits wait for it.
    """
    if postgres.running_cluster(primary_data_dir) is None:
        raise ServiceError(
            f"no primary runs from {primary_data_dir}: start it first (outbox.testing.postgres)"
        )
    existing = running_standby(standby_data_dir)
    if existing is None:
        ensure_port_free(port, "the PostgreSQL standby", "--standby-port")
        if not (standby_data_dir / "data" / "PG_VERSION").exists():
            _ensure_slot(primary_port, slot)
            _base_backup(standby_data_dir, primary_port, slot)
        existing = postgres.start(standby_data_dir, port)
    if synchronous:
        set_synchronous(primary_port, slot)
    wait_streaming(primary_port, slot, synchronous=synchronous)
    return existing


def stop_standby(standby_data_dir: Path, *, grace_s: float = 20.0) -> bool:
    """Stop the standby by its pid (fast shutdown); True if it was running.

    Its slot stays on the primary, so a synchronous primary's commits wait until it is
    started again (or set_synchronous(port, None) releases them).
    """
    return postgres.stop(standby_data_dir, grace_s=grace_s)


def promote(standby_data_dir: Path, *, timeout_s: float = 30.0) -> PostgresCluster:
    """Promote the standby (pg_ctl promote) and return once it accepts writes."""
    cluster = running_standby(standby_data_dir)
    if cluster is None:
        raise ServiceError(f"no standby runs from {standby_data_dir}: nothing to promote")
    result = _run_as_owner(
        [
            str(postgres_bin_dir() / "pg_ctl"),
            "-D", str(standby_data_dir / "data"),
            "-w", "-t", str(int(timeout_s)),
            "promote",
        ],
        timeout=timeout_s + 10,
    )
    if result.returncode != 0:
        raise ServiceError(
            f"pg_ctl promote of {standby_data_dir} failed: {result.stderr.strip()[-2000:]}"
        )
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with _connect(cluster.port) as conn:
                row = conn.execute(
                    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
                ).fetchone()
            if row and row[0] is False and row[1] == "off":
                return cluster
        except psycopg.OperationalError as exc:
            last = exc
        time.sleep(0.05)
    raise ServiceError(
        f"the promoted node on port {cluster.port} does not accept writes after "
        f"{timeout_s:.0f} s ({last}); see postgres.log in {standby_data_dir}"
    )


def failover_url(primary: PostgresCluster, standby: PostgresCluster, dbname: str) -> str:
    """A libpq URL that reaches whichever of the two nodes accepts writes.

    libpq tries the hosts in order and keeps the first that is not read-only, so a client
    that reconnects after a failover lands on the promoted standby without a new URL.
    """
    return (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/{dbname}"
        "?target_session_attrs=read-write"
    )
