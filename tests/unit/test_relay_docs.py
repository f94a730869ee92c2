"""docs/relay.md must describe every relay setting and every metric the relay exports."""

from __future__ import annotations

from pathlib import Path

from relay.metrics import RelayMetrics
from relay.settings import RelaySettings

DOC = (Path(__file__).resolve().parents[2] / "docs" / "relay.md").read_text()


def test_every_setting_is_in_the_configuration_table() -> None:
    for name in RelaySettings.model_fields:
        assert f"`OUTBOXKIT_RELAY_{name.upper()}`" in DOC, name
        assert f"`--{name.replace('_', '-')}`" in DOC, name


def test_every_metric_is_documented() -> None:
    for metric in RelayMetrics().registry.collect():
        assert f"`{metric.name}" in DOC, metric.name
