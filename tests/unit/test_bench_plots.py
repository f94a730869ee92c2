"""bench/plots.py: hand-written SVG that parses, scales its bars and refuses empty data."""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

SVG = "{http://www.w3.org/2000/svg}"
PLOTS_PY = Path(__file__).resolve().parents[2] / "bench" / "plots.py"


def _load() -> ModuleType:
    # bench/ is a folder of scripts, not a package: load the module from its file.
    spec = importlib.util.spec_from_file_location("bench_plots", PLOTS_PY)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


plots = _load()


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg.encode())  # noqa: S314 - SVG these tests just made


def bars_of(svg: str) -> list[tuple[float, float, float]]:
    """(x, y, height) of every bar, left to right."""
    root = parse(svg)
    rects = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]
    return sorted((float(r.get("x", 0)), float(r.get("y", 0)), float(r.get("height", 0)))
                  for r in rects)


def test_bar_heights_are_proportional_and_share_one_baseline() -> None:
    svg = plots.bar_chart(
        [plots.Bar(0, 1, 5), plots.Bar(1, 2, 10), plots.Bar(2, 3, 0)],
        title="t", x_label="x", y_label="y",
    )
    (_, y5, h5), (_, y10, h10), (_, y0, h0) = bars_of(svg)
    assert h10 == pytest.approx(2 * h5, abs=0.02)
    assert h0 == 0
    assert y5 + h5 == pytest.approx(y10 + h10) == pytest.approx(y0)
    assert y10 >= plots.TOP  # the tallest bar stays inside the plot
    assert h10 >= 0.75 * plots.PLOT_H  # and the axis does not waste the plot on headroom


def test_histogram_counts_samples_into_round_bins() -> None:
    svg = plots.histogram([0.5, 0.5, 0.5, 9.5], title="t", x_label="ms", bins=10)
    heights = [h for _, _, h in bars_of(svg)]
    assert len(heights) == 10
    assert heights[0] == pytest.approx(3 * heights[-1], abs=0.02)
    assert heights[1:-1] == [0] * 8


def test_histogram_marks_and_clipped_tail_are_drawn_and_told() -> None:
    svg = plots.histogram(
        [1.0] * 99 + [1000.0],
        title="latency < 10 ms & more",
        x_label="ms",
        marks=[plots.Mark("p50 1.0 ms", 1.0), plots.Mark("p99 1.0 ms", 1.0)],
        clip_above=10.0,
    )
    root = parse(svg)  # escaping keeps it well-formed XML
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "latency < 10 ms & more" in texts
    assert {"p50 1.0 ms", "p99 1.0 ms"} <= set(texts)
    assert any("1 above 10 not drawn" in t for t in texts)
    assert len([e for e in root.iter(f"{SVG}line") if e.get("class") == "mark"]) == 2


def test_throughput_turns_counts_into_messages_per_second() -> None:
    svg = plots.throughput(
        [(0.05, 100), (0.15, 100), (0.25, 50)],
        title="t",
        bucket_s=0.1,
        reference=plots.Mark("producer alone 2,000 msgs/s", 2000),
    )
    (_, _, first), (_, _, second), (_, _, third) = bars_of(svg)
    assert first == pytest.approx(second)
    assert third == pytest.approx(first / 2, abs=0.02)
    assert "1000" not in svg  # the axis reads msgs/s with separators, e.g. "1,000"
    assert "producer alone 2,000 msgs/s" in svg


@pytest.mark.parametrize(
    "draw",
    [
        lambda: plots.histogram([], title="latency", x_label="ms"),
        lambda: plots.throughput([], title="latency"),
        lambda: plots.bar_chart([], title="latency", x_label="x", y_label="y"),
    ],
)
def test_nothing_to_plot_is_a_clear_error(draw: object) -> None:
    with pytest.raises(ValueError, match=r"cannot plot 'latency': no (samples|data)"):
        draw()  # type: ignore[operator]


def test_steps_are_round() -> None:
    assert plots.nice_step(10, 5) == 2
    assert plots.nice_step(1, 4) == 0.25
    assert plots.nice_step(730, 8) == 100
    assert plots.axis(-3.2, 71, 8) == (-10, 80, 10)


def test_throughput_buckets_span_several_batches() -> None:
    # A batch every 0.1 s: 0.1 s buckets would alternate bursts and gaps, not show a rate.
    batches = [(1.013 + i * 0.1, 1000) for i in range(100)]
    svg = plots.throughput(batches, title="t", end_s=11.2)
    assert "buckets of 0.5 s" in svg
    inner = [h for _, _, h in bars_of(svg)][3:-2]  # whole buckets after start-up
    assert max(inner) == pytest.approx(min(inner))
