"""Small SVG charts for the benchmark suite, written by hand: no plotting library needed.

``bar_chart`` draws bars on linear axes starting at zero, with labelled marker lines;
``histogram`` (latency samples) and ``throughput`` (publish timeline) turn raw data into its
bars. Every function returns the SVG document as a string.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 760, 420
LEFT, RIGHT, TOP, BOTTOM = 80, 30, 56, 60
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
BAR_COLOUR = "#4e79a7"
MARK_COLOURS = ("#e15759", "#f28e2b", "#59a14f", "#b07aa1")
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
    x_low, x_end, x_step = axis(min(0.0, *(b.x0 for b in bars)), x_high, 8)
    y_high = max(b.height for b in bars)
    y_high = max(y_high, *(m.at for m in hlines)) if hlines else y_high
    _, y_end, y_step = axis(0.0, y_high * 1.05 or 1.0, 5)  # headroom for labels

    def sx(x: float) -> float:
        return LEFT + (x - x_low) / (x_end - x_low) * PLOT_W

    def sy(y: float) -> float:
        return TOP + PLOT_H - y / y_end * PLOT_H

    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif">',
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        _text(WIDTH / 2, 24, title, size=15, extra=' font-weight="bold"'),
    ]
    if note:
        out.append(_text(WIDTH / 2, 42, note, size=11, extra=' fill="#555"'))
    # Grid and tick labels first, so the bars are drawn over the grid lines.
    for i in range(round(y_end / y_step) + 1):
        y = i * y_step
        out.append(
            f'<line x1="{LEFT}" y1="{sy(y):.1f}" x2="{LEFT + PLOT_W}" y2="{sy(y):.1f}" '
            'stroke="#ddd"/>'
        )
        out.append(_text(LEFT - 6, sy(y) + 4, tick_label(y, y_step), anchor="end", size=11))
    for i in range(round((x_end - x_low) / x_step) + 1):
        x = x_low + i * x_step
        out.append(
            f'<line x1="{sx(x):.1f}" y1="{TOP + PLOT_H}" x2="{sx(x):.1f}" '
            f'y2="{TOP + PLOT_H + 5}" stroke="black"/>'
        )
        out.append(_text(sx(x), TOP + PLOT_H + 18, tick_label(x, x_step), size=11))
    for b in bars:
        top = sy(b.height)
        out.append(
            f'<rect class="bar" x="{sx(b.x0):.2f}" y="{top:.2f}" '
            f'width="{max(0.5, sx(b.x1) - sx(b.x0) - 1):.2f}" '
            f'height="{TOP + PLOT_H - top:.2f}" fill="{BAR_COLOUR}"/>'
        )
    out.append(
        f'<polyline points="{LEFT},{TOP} {LEFT},{TOP + PLOT_H} {LEFT + PLOT_W},{TOP + PLOT_H}" '
        'fill="none" stroke="black"/>'
    )
    for i, mark in enumerate(vlines):
        colour = MARK_COLOURS[i % len(MARK_COLOURS)]
        x = sx(mark.at)
        out.append(
            f'<line class="mark" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + PLOT_H}" '
            f'stroke="{colour}" stroke-width="2" stroke-dasharray="6 4"/>'
        )
        out.append(_text(x + 4, TOP + 14 + 14 * i, mark.label, anchor="start", size=12,
                         extra=f' fill="{colour}"{HALO}'))
    for i, mark in enumerate(hlines):
        colour = MARK_COLOURS[(i + len(vlines)) % len(MARK_COLOURS)]
        y = sy(mark.at)
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
    out.append("</svg>")
    return "\n".join(out) + "\n"


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
