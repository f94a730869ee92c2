"""What a drain cost, read from /proc: the whole machine, PostgreSQL's cluster, one process."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, every process, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 is index 0)."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return None


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads) so far, in seconds."""
    fields = _stat(pid)
    if fields is None:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / TICK


def cluster_cpu_s(postmaster: int) -> float:
    """CPU seconds of one PostgreSQL cluster so far: the postmaster, every live child, and
    (the postmaster's cutime + cstime) every child it has already reaped, so backends and
    WAL senders that exited inside a measurement still count."""
    own = _stat(postmaster)
    if own is None:
        return math.nan
    total = sum(int(own[i]) for i in (11, 12, 13, 14))
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None and int(fields[1]) == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's peak resident memory so far."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return math.nan


@dataclass
class Cost:
    """CPU seconds spent between two samples, by whom."""

    machine_s: float  # every process on the machine (busy jiffies / clock ticks)
    machine_busy: float  # fraction of all CPUs busy
    postgres_s: float
    engine_s: float
    broker_s: float  # NaN when the broker is not ours to watch
    wall_s: float

    @property
    def others_s(self) -> float:
        """Machine CPU that none of the measured processes spent (this script, the writers,
        anyone else on the machine, e.g. tests)."""
        broker = 0.0 if math.isnan(self.broker_s) else self.broker_s
        return self.machine_s - self.postgres_s - self.engine_s - broker


class Sampler:
    """Samples CPU counters now; ``cost()`` gives what was spent since.

    *engine* is the process under test when it already runs; ``None`` when it is spawned
    after this sample (then all of its CPU counts).
    """

    def __init__(self, postmaster: int, broker: int | None, engine: int | None = None) -> None:
        self.postmaster, self.broker = postmaster, broker
        self._started = time.monotonic()
        self._ticks = machine_ticks()
        self._pg = cluster_cpu_s(postmaster)
        self._engine = process_cpu_s(engine) if engine else 0.0
        self._broker = process_cpu_s(broker) if broker else math.nan

    def cost(self, engine: int) -> Cost:
        """Call it while *engine* still runs: a process that exited has no counters."""
        busy, total = machine_ticks()
        d_busy, d_total = busy - self._ticks[0], max(1, total - self._ticks[1])
        return Cost(
            machine_s=d_busy / TICK,
            machine_busy=d_busy / d_total,
            postgres_s=cluster_cpu_s(self.postmaster) - self._pg,
            engine_s=process_cpu_s(engine) - self._engine,
            broker_s=(process_cpu_s(self.broker) - self._broker) if self.broker else math.nan,
            wall_s=time.monotonic() - self._started,
        )
