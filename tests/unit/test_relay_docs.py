"""docs/relay.md must describe every metric the relay exports, and point to the settings."""

from __future__ import annotations

from pathlib import Path

from relay.metrics import RelayMetrics

DOC = (Path(__file__).resolve().parents[2] / "docs" / "relay.md").read_text()


def test_the_settings_are_found_through_the_generated_reference() -> None:
    # The settings table lives in docs/configuration.md (tests/unit/test_configuration_docs.py
    # keeps it in step with RelaySettings); relay.md only links to it.
    assert "[configuration.md](configuration.md)" in DOC
    assert "`OUTBOXKIT_RELAY_BATCH_SIZE`" not in DOC, "a second, hand-kept settings table"


def test_every_metric_is_documented() -> None:
    for metric in RelayMetrics().registry.collect():
        assert f"`{metric.name}" in DOC, metric.name
