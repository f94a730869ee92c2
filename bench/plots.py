"""Small SVG charts for the benchmark suite, written by hand: no plotting library needed.

``bar_chart`` draws bars on linear axes starting at zero, with labelled marker lines, and
``line_chart`` lines through points on the same axes; ``stack`` puts charts one under the other;
``histogram`` (latency samples) and ``throughput`` (publish timeline) turn raw data into its
bars. Every function returns the SVG document as a string.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 760, 420
LEFT, RIGHT, TOP, BOTTOM = 80, 30, 56, 60
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
BAR_COLOUR = "#4e79a7"
MARK_COLOURS = ("#e15759", "#f28e2b", "#59a14f", "#b07aa1")
# One per line of a line chart (a colour-blind-safe ten, told apart by the legend).
LINE_COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                "#ff9da7", "#9c755f", "#bab0ac")
HALO = ' stroke="white" stroke-width="4" paint-order="stroke"'  # labels stay legible on bars


@dataclass(frozen=True)
class Bar:
    x0: float
    x1: float
    height: float


@dataclass(frozen=True)
class Mark:
    """A labelled line across the plot: vertical at x=*at*, or horizontal at y=*at*."""

    label: str
    at: float


def nice_step(span: float, count: int) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten) giving about *count* intervals."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(1, count)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 2.5, 5, 10):
        if raw <= multiple * magnitude * (1 + 1e-9):
            return multiple * magnitude
    return 10 * magnitude


def axis(low: float, high: float, count: int) -> tuple[float, float, float]:
    """(start, end, step) of an axis covering low..high in whole round steps."""
    step = nice_step(high - low, count)
    start = step * math.floor(low / step + 1e-9)
    return start, max(start + step, step * math.ceil(high / step - 1e-9)), step


def tick_label(value: float, step: float) -> str:
    if step >= 1:
        return f"{value:,.0f}"
    # As many decimals as the step needs: 0.5 → 1, 0.25 → 2.
    decimals = next(
        (d for d in range(1, 7) if abs(step * 10**d - round(step * 10**d)) < 1e-6), 6
    )
    return f"{value:.{decimals}f}"


def _text(x: float, y: float, content: str, *, anchor: str = "middle", size: int = 12,
          extra: str = "") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{extra}>'
        f"{escape(content)}</text>"
    )


def bar_chart(
    bars: Sequence[Bar],
    *,
    title: str,
    x_label: str,
    y_label: str,
    vlines: Iterable[Mark] = (),
    hlines: Iterable[Mark] = (),
    note: str = "",
) -> str:
    """An SVG bar chart; both axes start at zero (or at the lowest bar, if negative)."""
    if not bars:
        raise ValueError(f"cannot plot {title!r}: no data")
    if any(not math.isfinite(b.height) or b.height < 0 or b.x1 <= b.x0 for b in bars):
        raise ValueError(f"cannot plot {title!r}: bars need finite heights >= 0 and x1 > x0")
    vlines, hlines = list(vlines), list(hlines)
    x_high = max(b.x1 for b in bars)
    x_high = max(x_high, *(m.at for m in vlines)) if vlines else x_high
    y_high = max(b.height for b in bars)
    y_high = max(y_high, *(m.at for m in hlines)) if hlines else y_high
    frame = _Frame(title, note, min(0.0, *(b.x0 for b in bars)), x_high, y_high)
    out = frame.open()
    for b in bars:
        top = frame.sy(b.height)
        out.append(
            f'<rect class="bar" x="{frame.sx(b.x0):.2f}" y="{top:.2f}" '
            f'width="{max(0.5, frame.sx(b.x1) - frame.sx(b.x0) - 1):.2f}" '
            f'height="{TOP + PLOT_H - top:.2f}" fill="{BAR_COLOUR}"/>'
        )
    out += frame.close(x_label, y_label, vlines, hlines)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def line_chart(
    lines: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    vlines: Iterable[Mark] = (),
    note: str = "",
) -> str:
    """An SVG chart of one line per name through its (x, y) points, on axes from zero (a flat
    line then looks flat, and a small drift small), with a legend under the plot."""
    points = [pt for pts in lines.values() for pt in pts]
    if not points:
        raise ValueError(f"cannot plot {title!r}: no data")
    if any(not (math.isfinite(x) and math.isfinite(y)) or y < 0 for x, y in points):
        raise ValueError(f"cannot plot {title!r}: points need finite x and y >= 0")
    vlines = list(vlines)
    x_high = max([x for x, _ in points] + [m.at for m in vlines])
    frame = _Frame(title, note, min(0.0, *(x for x, _ in points)), x_high,
                   max(y for _, y in points))
    per_row = 4
    rows = math.ceil(len(lines) / per_row)
    height = HEIGHT + 18 * rows
    out = frame.open(height)
    for i, (name, pts) in enumerate(lines.items()):
        colour = LINE_COLOURS[i % len(LINE_COLOURS)]
        drawn = " ".join(f"{frame.sx(x):.1f},{frame.sy(y):.1f}" for x, y in sorted(pts))
        out.append(f'<polyline class="line" points="{drawn}" fill="none" stroke="{colour}" '
                   'stroke-width="1.5"/>')
        lx = LEFT + (i % per_row) * PLOT_W / per_row
        ly = HEIGHT + 4 + 18 * (i // per_row)
        out.append(f'<line x1="{lx:.1f}" y1="{ly - 4:.1f}" x2="{lx + 18:.1f}" y2="{ly - 4:.1f}" '
                   f'stroke="{colour}" stroke-width="3"/>')
        out.append(_text(lx + 22, ly, name, anchor="start", size=11))
    out += frame.close(x_label, y_label, vlines, ())
    out.append("</svg>")
    return "\n".join(out) + "\n"


def stack(documents: Sequence[str]) -> str:
    """SVG documents of this module (panels) one under the other in one document."""
    inner, y = [], 0.0
    for doc in documents:
        root = doc.split("\n", 1)[1]  # without the XML declaration
        height = float(root.split('height="', 1)[1].split('"', 1)[0])
        inner.append(root.replace("<svg ", f'<svg y="{y:.0f}" ', 1))
        y += height
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y:.0f}" '
        f'viewBox="0 0 {WIDTH} {y:.0f}">\n' + "".join(inner) + "</svg>\n"
    )


class _Frame:
    """What every chart here has: title, note, grid, ticks, axes, marks and axis labels."""

    def __init__(self, title: str, note: str, x_low: float, x_high: float,
                 y_high: float) -> None:
        self.title, self.note = title, note
        self.x_low, self.x_end, self.x_step = axis(x_low, x_high, 8)
        _, self.y_end, self.y_step = axis(0.0, y_high * 1.05 or 1.0, 5)  # headroom for labels

    def sx(self, x: float) -> float:
        return LEFT + (x - self.x_low) / (self.x_end - self.x_low) * PLOT_W

    def sy(self, y: float) -> float:
        return TOP + PLOT_H - y / self.y_end * PLOT_H

    def open(self, height: int = HEIGHT) -> list[str]:
        """The document's start, title, note and grid: drawn first, so data goes over it."""
        sx, sy = self.sx, self.sy
        out = [
            '<?xml version="1.0" encoding="UTF-8"?>',
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">',
            f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>',
            _text(WIDTH / 2, 24, self.title, size=15, extra=' font-weight="bold"'),
        ]
        if self.note:
            out.append(_text(WIDTH / 2, 42, self.note, size=11, extra=' fill="#555"'))
        for i in range(round(self.y_end / self.y_step) + 1):
            y = i * self.y_step
            out.append(
                f'<line x1="{LEFT}" y1="{sy(y):.1f}" x2="{LEFT + PLOT_W}" y2="{sy(y):.1f}" '
                'stroke="#ddd"/>'
            )
            out.append(_text(LEFT - 6, sy(y) + 4, tick_label(y, self.y_step), anchor="end",
                             size=11))
        for i in range(round((self.x_end - self.x_low) / self.x_step) + 1):
            x = self.x_low + i * self.x_step
            out.append(
                f'<line x1="{sx(x):.1f}" y1="{TOP + PLOT_H}" x2="{sx(x):.1f}" '
                f'y2="{TOP + PLOT_H + 5}" stroke="black"/>'
            )
            out.append(_text(sx(x), TOP + PLOT_H + 18, tick_label(x, self.x_step), size=11))
        return out

    def close(self, x_label: str, y_label: str, vlines: Sequence[Mark],
              hlines: Sequence[Mark]) -> list[str]:
        """The axes, the marks and the axis labels, over the data."""
        out = [
            f'<polyline points="{LEFT},{TOP} {LEFT},{TOP + PLOT_H} {LEFT + PLOT_W},'
            f'{TOP + PLOT_H}" fill="none" stroke="black"/>'
        ]
        for i, mark in enumerate(vlines):
            colour = MARK_COLOURS[i % len(MARK_COLOURS)]
            x = self.sx(mark.at)
            out.append(
                f'<line class="mark" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + PLOT_H}" '
                f'stroke="{colour}" stroke-width="2" stroke-dasharray="6 4"/>'
            )
            out.append(_text(x + 4, TOP + 14 + 14 * i, mark.label, anchor="start", size=12,
                             extra=f' fill="{colour}"{HALO}'))
        for i, mark in enumerate(hlines):
            colour = MARK_COLOURS[(i + len(vlines)) % len(MARK_COLOURS)]
            y = self.sy(mark.at)
            out.append(
                f'<line class="mark" x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + PLOT_W}" y2="{y:.1f}" '
                f'stroke="{colour}" stroke-width="2" stroke-dasharray="6 4"/>'
            )
            # At the left: plots here have their data to the right (a drain's start-up gap).
            out.append(_text(LEFT + 6, y - 5, mark.label, anchor="start", size=12,
                             extra=f' fill="{colour}"{HALO}'))
        out.append(_text(LEFT + PLOT_W / 2, HEIGHT - 14, x_label, size=12))
        out.append(
            _text(18, TOP + PLOT_H / 2, y_label, size=12,
                  extra=f' transform="rotate(-90 18 {TOP + PLOT_H / 2:.1f})"')
        )
        return out


def histogram(
    samples: Sequence[float],
    *,
    title: str,
    x_label: str,
    marks: Iterable[Mark] = (),
    bins: int = 40,
    clip_above: float | None = None,
) -> str:
    """A histogram of *samples*; those above *clip_above* are counted in a note, not drawn."""
    if not samples:
        raise ValueError(f"cannot plot {title!r}: no samples")
    shown = [s for s in samples if clip_above is None or s <= clip_above]
    if not shown:
        raise ValueError(f"cannot plot {title!r}: every sample is above {clip_above}")
    # Round bin edges, on the axis' grid, read better.
    width = nice_step(max(shown) - min(0.0, *shown), bins)
    low, high = width * math.floor(min(0.0, *shown) / width), max(shown)
    counts = [0] * (math.floor((high - low) / width) + 1)
    for s in shown:
        counts[min(len(counts) - 1, math.floor((s - low) / width))] += 1
    bars = [Bar(low + i * width, low + (i + 1) * width, c) for i, c in enumerate(counts)]
    hidden = len(samples) - len(shown)
    note = f"{len(samples):,} samples, bins of {width:g}"
    if hidden:
        note += f"; {hidden:,} above {clip_above:g} not drawn"
    return bar_chart(bars, title=title, x_label=x_label, y_label="samples", vlines=marks,
                     note=note)


def throughput(
    points: Sequence[tuple[float, float]],
    *,
    title: str,
    end_s: float | None = None,
    bucket_s: float | None = None,
    reference: Mark | None = None,
) -> str:
    """Messages per second per time bucket, from (seconds, messages) points."""
    if not points:
        raise ValueError(f"cannot plot {title!r}: no data")
    times = sorted(t for t, _ in points)
    low, high = min(0.0, times[0]), max(end_s or 0.0, times[-1])
    # Points come a batch at a time: a bucket narrower than a few gaps between batches
    # would show bursts and silences instead of a rate.
    gaps = sorted(b - a for a, b in pairwise(times) if b > a)
    typical_gap = gaps[len(gaps) // 2] if gaps else 0.0
    bucket = bucket_s or nice_step(max(high - low, 40 * 3 * typical_gap), 40)
    counts = [0.0] * (math.floor((high - low) / bucket) + 1)
    for t, n in points:
        counts[min(len(counts) - 1, math.floor((t - low) / bucket))] += n
    bars = [Bar(low + i * bucket, low + (i + 1) * bucket, c / bucket) for i, c in enumerate(counts)]
    total = sum(n for _, n in points)
    return bar_chart(
        bars,
        title=title,
        x_label="seconds",
        y_label="messages per second",
        hlines=[reference] if reference else (),
        note=f"{total:,.0f} messages, buckets of {bucket:g} s",
    )
