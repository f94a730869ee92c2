"""The figures every benchmark prints and writes: one table, one JSON shape.

JSON: ``{"name", "value", "unit", "ceiling", "ratio", "goal", "met"}`` per figure (plus an
optional ``note``), as the benchmark suite's ``bench/results`` format expects.
"""

from __future__ import annotations

import math
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
