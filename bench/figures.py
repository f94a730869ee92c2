"""The figures every benchmark prints and writes: one table, one JSON shape.

JSON: ``{"name", "value", "unit", "ceiling", "ratio", "goal", "met"}`` per figure (plus an
optional ``note``), as the benchmark suite's ``bench/results`` format expects.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    ceiling: float | None = None
    ratio: float | None = None
    goal: str | None = None
    met: bool | None = None
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        def clean(x: float | None) -> float | None:
            return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, 4)

        return {
            "name": self.name,
            "value": clean(self.value),
            "unit": self.unit,
            "ceiling": clean(self.ceiling),
            "ratio": clean(self.ratio),
            "goal": self.goal,
            "met": self.met,
            **({"note": self.note} if self.note else {}),
        }


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"


def print_table(figures: list[Figure]) -> None:
    header = ("figure", "value", "unit", "ceiling", "ratio", "goal", "met")
    rows = [
        (
            f.name,
            fmt(f.value),
            f.unit,
            fmt(f.ceiling),
            fmt(f.ratio),
            f.goal or "-",
            "-" if f.met is None else ("yes" if f.met else "NO"),
        )
        for f in figures
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line.format(*r))


@dataclass
class Spent:
    """What one measured run cost: its rate, its own process's cores, the machine's load."""

    rate: float  # messages per second
    cores: float  # CPU seconds per second of the measured process (all its threads)
    busy: float  # fraction of all the machine's CPUs busy meanwhile (every process)


def cpu_budget(prefix: str, runs: list[Spent], ceiling: float, cpus: int) -> list[Figure]:
    """Where a throughput ratio is bounded on this machine, from what each message costs.

    A rate divided by the machine's busy fraction is the rate this per-message cost would
    give with every core busy: an upper bound for any amount of concurrency (threads,
    processes) at that cost, here. Divided by the process's own cores instead, it is the
    rate one process would reach with a whole core (the bound of one interpreter's lock).
    Other processes' work counts as the run's cost: measure on a quiet machine.
    """

    def med(values: list[float]) -> float:
        ok = [v for v in values if math.isfinite(v)]
        return statistics.median(ok) if ok else math.nan

    def per(f: Callable[[Spent], float]) -> float:
        return med([f(r) if r.busy > 0 and r.cores > 0 else math.nan for r in runs])

    cost_us = per(lambda r: r.busy * cpus / r.rate * 1e6)
    machine = per(lambda r: r.rate / r.busy) / ceiling
    one = per(lambda r: r.rate / r.cores) / ceiling
    return [
        Figure(f"{prefix}.machine_cpu_us_per_msg", cost_us, "us",
               note=f"every process's CPU per message ({cpus} CPUs), median of rounds"),
        Figure(f"{prefix}.machine_bound_ratio", machine, "ratio", ceiling, machine,
               note="the ratio at this cost with every core busy: no concurrency beats it"),
        Figure(f"{prefix}.one_process_bound_ratio", one, "ratio", ceiling, one,
               note="the ratio if this one process had a whole core to itself"),
    ]


def confluent_version() -> str:
    """confluent-kafka's version and librdkafka's, for a bench's machine line."""
    try:
        import confluent_kafka  # noqa: PLC0415
    except ImportError:
        return "not installed"
    found: Any = confluent_kafka.version()  # a str, or (str, int) in older releases
    version = found[0] if isinstance(found, tuple) else found
    return f"{version} (librdkafka {confluent_kafka.libversion()[0]})"
