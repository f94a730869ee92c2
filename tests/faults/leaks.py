"""What a process holds, read from /proc without stopping it, and the rule that calls a
growth a leak. The soak (:mod:`tests.faults.soak`) samples every daemon with these.

A process's PostgreSQL connections are its TCP sockets to the server's port whose local
port PostgreSQL also lists in ``pg_stat_activity`` as a client's. None of the example's
daemons sets an ``application_name`` (a library's pool cannot be told apart by it anyway),
while a socket inode in ``/proc/<pid>/fd`` belongs to exactly one process: counting from the
sockets cannot credit one daemon with another's connection. Asking ``pg_stat_activity`` too
drops a socket whose backend is gone (a half-closed one still holds a descriptor, and the
descriptor count sees that).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, text

METRICS = ("rss_mib", "fds", "threads", "pg_connections")
UNITS = {"rss_mib": "MiB", "fds": "descriptors", "threads": "threads",
         "pg_connections": "connections"}
TITLES = {"rss_mib": "resident memory (RSS)", "fds": "open file descriptors",
          "threads": "threads", "pg_connections": "PostgreSQL connections"}
GROWTH = 0.10  # the most a metric may grow from the second quarter to the last
# The least growth that counts, whatever the percentage: a count of 10 threads that reads 11
# is a pool worker that happened to be alive, not a leak; a leak keeps growing and passes
# these within minutes. RSS in MiB: allocator noise on a small process is about that.
FLOORS = {"rss_mib": 2.0, "fds": 2.0, "threads": 1.0, "pg_connections": 1.0}
ESTABLISHED = "01"  # the state column of /proc/net/tcp


def proc_stats(pid: int, root: Path = Path("/proc")) -> dict[str, float]:
    """RSS (MiB), open descriptors, threads and CPU seconds so far (not judged: it tells how
    busy the load keeps a process) of *pid*; raises OSError once it is gone."""
    status: dict[str, str] = {}
    for line in (root / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        status[key] = value.strip()
    if status.get("State", "").startswith("Z"):  # exited, not yet reaped: nothing it holds
        raise ProcessLookupError(f"process {pid} has exited")
    return {
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "fds": float(len(os.listdir(root / str(pid) / "fd"))),
        "threads": float(status["Threads"]),
        "cpu_s": cpu_seconds(pid, root),
    }


def cpu_seconds(pid: int, root: Path = Path("/proc")) -> float:
    # utime and stime, the 14th and 15th fields; the name before them may hold spaces.
    fields = (root / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def socket_inodes(pid: int, root: Path = Path("/proc")) -> set[str]:
    found = set()
    fd_dir = root / str(pid) / "fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:  # closed between the listing and the read
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


def local_ports_to(pid: int, remote_port: int, root: Path = Path("/proc")) -> set[int]:
    """Local ports of *pid*'s established TCP connections to *remote_port* (v4 and v6)."""
    inodes = socket_inodes(pid, root)
    ports = set()
    for table in ("tcp", "tcp6"):
        path = root / str(pid) / "net" / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            if (state == ESTABLISHED and inode in inodes
                    and int(remote.rsplit(":", 1)[1], 16) == remote_port):
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def pg_client_ports(conn: Connection) -> dict[int, str]:
    """The client port of every TCP backend PostgreSQL has now, with its state."""
    rows = conn.execute(text("SELECT client_port, coalesce(state, '') FROM pg_stat_activity "
                             "WHERE client_port IS NOT NULL AND client_port > 0")).all()
    return {int(port): str(state) for port, state in rows}


def pg_connections(pid: int, pg_port: int, clients: Mapping[int, str]) -> dict[str, float]:
    """*pid*'s connections, and how many of them are idle in a transaction (not judged: a
    connection checked out and forgotten shows there, a pool's idle one does not)."""
    mine = [clients[p] for p in local_ports_to(pid, pg_port) if p in clients]
    return {"pg_connections": float(len(mine)),
            "pg_idle_in_transaction": float(sum(s.startswith("idle in transaction")
                                                for s in mine))}


def sample(pids: Mapping[str, int], conn: Connection, pg_port: int) -> dict[str, dict[str, float]]:
    """Every metric of every live process of *pids* (one missing from the answer is gone)."""
    clients = pg_client_ports(conn)
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = {**proc_stats(pid), **pg_connections(pid, pg_port, clients)}
        except OSError:
            continue
    return out


# --- the rule ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    process: str
    metric: str
    start: float | None  # the second quarter's median
    end: float | None  # the last quarter's median
    ok: bool
    why: str = ""

    @property
    def growth(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        if self.start == 0:
            return 0.0 if self.end == 0 else float("inf")
        return (self.end - self.start) / self.start


def quarters(values: Sequence[float | None]) -> tuple[list[float | None], list[float | None]]:
    """The second quarter and the last of a series; the first is the warm-up (imports, pools
    and buffers filling, the first rebalance) and the third only separates the two."""
    n = len(values)
    return list(values[n // 4: n // 2]), list(values[3 * n // 4:])


def judge(process: str, metric: str, values: Sequence[float | None]) -> Verdict:
    """Medians, not extremes: a leak grows steadily, so it moves the last quarter's median by
    about half the run's leak, while a one-off (a burst's extra pool connection, a collection
    that has not run yet) moves one sample and not the median. The max of the last quarter
    against the second's median would fail on such a one-off; a slow leak still shows."""
    if len(values) < 4:
        return Verdict(process, metric, None, None, False, f"{len(values)} samples: too few")
    second, last = quarters(values)
    if any(v is None for v in second + last):
        return Verdict(process, metric, None, None, False, "not sampled throughout (gone?)")
    start = statistics.median(v for v in second if v is not None)
    end = statistics.median(v for v in last if v is not None)
    limit = max(GROWTH * start, FLOORS[metric])
    if end - start > limit:
        return Verdict(process, metric, start, end, False,
                       f"grew by {end - start:g} (more than {limit:g})")
    return Verdict(process, metric, start, end, True)


def judge_all(series: Mapping[str, Mapping[str, Sequence[float | None]]],
              metrics: Iterable[str] = METRICS) -> list[Verdict]:
    """A verdict per process of *series* (process → metric → values) and metric."""
    wanted = list(metrics)
    return [judge(process, metric, by_metric[metric])
            for process, by_metric in series.items() for metric in wanted]
