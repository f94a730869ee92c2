"""The leak soak's rule (tests/faults/leaks.py) on made-up series, and its plot."""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET

import pytest

from tests.faults import leaks, soak

SVG = "{http://www.w3.org/2000/svg}"


def quarters_of(second: list[float], last: list[float], n: int = 4) -> list[float]:
    """A 4n-sample series whose second quarter is *second* and last quarter *last*; the
    warm-up (first) quarter starts far lower, as a process does."""
    return [1.0] * n + second + [(second[-1] + last[0]) / 2] * n + last


def test_a_flat_noisy_series_passes() -> None:
    rng = random.Random(7)
    rss = [80 + rng.uniform(-0.8, 0.8) for _ in range(60)]
    assert leaks.judge("relay-1", "rss_mib", rss).ok


def test_a_fifteen_percent_leak_fails_and_nine_percent_passes() -> None:
    leaked = leaks.judge("consumer-1", "rss_mib", quarters_of([100.0] * 4, [115.0] * 4))
    assert not leaked.ok
    assert leaked.growth == pytest.approx(0.15)
    assert "grew by 15" in leaked.why
    assert leaks.judge("consumer-1", "rss_mib", quarters_of([100.0] * 4, [109.0] * 4)).ok


def test_a_steady_leak_over_the_run_fails() -> None:
    # +0.5 % a sample over 60: the quarters' medians are 30 samples apart (+15 %). (At
    # +0.3 % they would be +9 % apart and pass: the rule allows about 18 % over the run.)
    rss = [100 * (1 + 0.005 * i) for i in range(60)]
    verdict = leaks.judge("agent-1", "rss_mib", rss)
    assert not verdict.ok
    assert verdict.growth is not None
    assert verdict.growth > 0.10


def test_plus_or_minus_one_on_small_counts_passes_but_more_fails() -> None:
    assert leaks.judge("agent-1", "threads", quarters_of([10, 11, 10, 10], [11, 10, 11, 11])).ok
    assert leaks.judge("agent-1", "threads", quarters_of([5, 5, 5, 5], [6, 6, 6, 6])).ok
    assert not leaks.judge("agent-1", "threads", quarters_of([5, 5, 5, 5], [7, 7, 7, 7])).ok
    assert leaks.judge("relay-1", "fds", quarters_of([12, 13, 12, 12], [14, 13, 14, 14])).ok
    assert not leaks.judge("relay-1", "fds", quarters_of([12] * 4, [15] * 4)).ok
    assert leaks.judge("relay-1", "pg_connections", quarters_of([1] * 4, [2] * 4)).ok
    assert not leaks.judge("relay-1", "pg_connections", quarters_of([1] * 4, [3] * 4)).ok


def test_a_one_off_in_the_last_quarter_does_not_fail() -> None:
    # A burst opened a pool's overflow connections once: one sample, not the median.
    assert leaks.judge("consumer-1", "pg_connections",
                       quarters_of([4] * 4, [4, 9, 4, 4])).ok


def test_the_warm_up_quarter_is_not_compared() -> None:
    assert leaks.judge("consumer-1", "fds", [3, 5, 8, 20] + [20] * 12).ok


def test_a_process_gone_or_too_few_samples_fails() -> None:
    gone = leaks.judge("relay-2", "threads", [7.0] * 10 + [None] * 6)
    assert not gone.ok
    assert "not sampled" in gone.why
    assert not leaks.judge("relay-2", "threads", [7.0, 7.0, 7.0]).ok


def test_judge_all_gives_a_verdict_per_process_and_metric() -> None:
    flat = {m: [3.0] * 8 for m in leaks.METRICS}
    leaky = {**flat, "fds": [3.0] * 4 + [30.0] * 4}
    verdicts = leaks.judge_all({"a": flat, "b": leaky})
    assert len(verdicts) == 2 * len(leaks.METRICS)
    assert [(v.process, v.metric) for v in verdicts if not v.ok] == [("b", "fds")]


def test_the_plot_has_a_panel_per_metric_and_a_line_per_process() -> None:
    samples = [{"t_min": i * 0.25, "processes": {
        "relay-1": {"rss_mib": 80.0, "fds": 12.0, "threads": 7.0, "pg_connections": 4.0},
        "agent-1": {"rss_mib": 70.0 + i, "fds": 9.0, "threads": 3.0, "pg_connections": 3.0},
    }} for i in range(12)]
    svg = soak.plot(samples, ["relay-1", "agent-1"], "test")
    root = ET.fromstring(svg.encode())  # noqa: S314 - SVG this test just made
    panels = root.findall(f"{SVG}svg")
    assert len(panels) == len(leaks.METRICS)
    for panel in panels:
        lines = [p for p in panel.iter(f"{SVG}polyline") if p.get("class") == "line"]
        assert len(lines) == 2
        assert all(len(p.get("points", "").split()) == 12 for p in lines)
        assert len([m for m in panel.iter(f"{SVG}line") if m.get("class") == "mark"]) == 3
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "test: resident memory (RSS)" in texts
    assert "relay-1" in texts
    # Stacked one under the other: each panel starts where the one above ends.
    tops = [float(p.get("y", 0)) for p in panels]
    assert tops == sorted(tops)
    assert len(set(tops)) == len(tops)
