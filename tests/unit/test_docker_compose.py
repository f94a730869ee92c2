"""docker-compose.yml cannot run here (no Docker engine), so its shape is what we check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def test_names_postgres_16_and_the_official_kafka_image_in_kraft_mode() -> None:
    services = compose()["services"]
    assert services["postgres"]["image"] == "postgres:16"
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_publishes_the_ports_on_loopback_only() -> None:
    services = compose()["services"]
    assert services["postgres"]["ports"] == ["127.0.0.1:5432:5432"]
    assert services["kafka"]["ports"] == ["127.0.0.1:9092:9092"]


def test_every_long_running_service_has_a_health_check() -> None:
    for name, service in compose()["services"].items():
        if name != "migrate":
            assert "test" in service.get("healthcheck", {}), name


def test_the_relay_is_built_here_and_starts_after_migrate_and_a_healthy_broker() -> None:
    services = compose()["services"]
    relay = services["relay"]
    assert relay["build"] == "."
    assert relay["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert relay["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert relay["environment"]["OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP"] == "kafka:19092"
    assert services["migrate"]["command"] == ["migrate"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["outbox"]' in dockerfile
