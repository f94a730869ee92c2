"""docs/alerts.yml is a valid Prometheus rules file that only names metrics outboxkit exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from consumers.metrics import ConsumerMetrics
from relay.metrics import RelayMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = yaml.safe_load((ROOT / "docs" / "alerts.yml").read_text())
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
METRIC = re.compile(r"\boutboxkit_[a-z0-9_]+\b")
# What a sample of each metric type is called, from its family's name.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(registry: CollectorRegistry) -> set[str]:
    # Labelled metrics have no samples until first used, so names come from the families.
    return {family.name + suffix for family in registry.collect()
            for suffix in SUFFIXES[family.type]}


def rules() -> list[dict[str, Any]]:
    return [rule for group in RULES["groups"] for rule in group["rules"]]


def test_it_has_the_rule_group_structure_prometheus_loads() -> None:
    assert set(RULES) == {"groups"}
    names = [group["name"] for group in RULES["groups"]]
    assert len(names) == len(set(names)), "group names must be unique"
    for group in RULES["groups"]:
        assert set(group) == {"name", "rules"}, group["name"]
        assert group["rules"], group["name"]
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"]), rule
        assert isinstance(rule["expr"], str)
        assert rule["expr"].strip()
        assert "for" not in rule or DURATION.match(rule["for"]), rule
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule
        assert {"summary", "description"} <= set(rule["annotations"]), rule


def test_every_metric_in_an_expression_is_exported() -> None:
    known = exported(RelayMetrics().registry) | exported(ConsumerMetrics().registry)
    for rule in rules():
        named = set(METRIC.findall(rule["expr"]))
        assert named, rule["alert"]
        assert named <= known, f"{rule['alert']}: {named - known} is not exported"


def test_label_values_are_ones_the_relay_sets() -> None:
    # relay/daemon.py sets the operations gauge for these two statuses only.
    for rule in rules():
        for status in re.findall(r'status="([^"]+)"', rule["expr"]):
            assert status in {"unknown", "needs-human"}, rule["alert"]


def test_the_alerts_asked_for_are_there() -> None:
    exprs = " ".join(rule["expr"] for rule in rules())
    for metric in ("outboxkit_relay_oldest_pending_age_seconds",
                   "outboxkit_relay_failed_messages",
                   "outboxkit_consumer_dead_lettered_total",
                   "outboxkit_consumer_lag_total_messages",
                   'outboxkit_relay_unsettled_operations{status="needs-human"}'):
        assert metric in exprs, metric


def test_the_operations_guide_lists_every_metric_and_every_alert() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    for registry in (RelayMetrics().registry, ConsumerMetrics().registry):
        for family in registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            assert f"`{name}" in guide, name
    for rule in rules():
        assert f"`{rule['alert']}`" in guide, rule["alert"]
