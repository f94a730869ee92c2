"""docker-compose.yml cannot run here (no Docker engine), so what we check is that it agrees
with the code it configures: every variable it sets is a setting outboxkit reads, the health
check asks the port the relay serves, and the commands in its header reach what it publishes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from outbox.cli.main import main as outbox_cli
from relay.settings import RelaySettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def image_command() -> list[str]:
    """The Dockerfile's CMD: what a service built here runs unless it sets a command."""
    line = next(x for x in (ROOT / "Dockerfile").read_text().splitlines() if x.startswith("CMD "))
    command = json.loads(line.removeprefix("CMD "))
    assert isinstance(command, list)
    return command


def variables_read_by(command: str) -> set[str]:
    """The environment variables ``outbox <command>`` reads."""
    if command == "relay":  # its settings, from OUTBOXKIT_RELAY_<field>
        return {f"OUTBOXKIT_RELAY_{name.upper()}" for name in RelaySettings.model_fields}
    click_command = outbox_cli.commands[command]
    return {p.envvar for p in click_command.params if isinstance(p.envvar, str)}


def services() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    found = data["services"]
    assert isinstance(found, dict)
    return found


def test_every_outboxkit_variable_is_one_its_command_reads() -> None:
    # A misspelt or renamed setting is ignored (pydantic-settings' extra="ignore", click's
    # unknown variables): the service would start with the default instead, silently.
    for name, service in services().items():
        if service.get("build") != ".":
            continue
        command = (service.get("command") or image_command())[0]
        read = variables_read_by(command)
        for variable in service.get("environment", {}):
            if variable.startswith("OUTBOXKIT_"):
                assert variable in read, f"{name}: outbox {command} does not read {variable}"


def test_the_relay_health_check_asks_the_port_the_relay_serves() -> None:
    relay = services()["relay"]
    command = relay.get("command") or image_command()
    port = command[command.index("--http-port") + 1]
    assert f"127.0.0.1::{port}" in relay["ports"]
    check = " ".join(relay["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/readyz" in check


def test_the_relay_reaches_kafka_on_its_inter_container_listener() -> None:
    found = services()
    bootstrap = found["relay"]["environment"]["OUTBOXKIT_RELAY_KAFKA_BOOTSTRAP"]
    advertised = found["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert f"PLAINTEXT://{bootstrap}" in advertised


def test_the_header_commands_reach_the_published_services() -> None:
    """The exports in the file's header are what a user copies: they must name the database
    and the ports the services publish."""
    found = services()
    header = COMPOSE.read_text().split("services:", 1)[0]
    exports = dict(re.findall(r"export (\w+)=(\S+)", header))
    database = urlsplit(exports["OUTBOXKIT_DATABASE_URL"])
    postgres = found["postgres"]["environment"]
    assert (database.username, database.password, database.path.lstrip("/")) == (
        postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], postgres["POSTGRES_DB"])
    assert f"127.0.0.1:{database.port}:5432" in found["postgres"]["ports"]
    kafka_port = exports["OUTBOXKIT_KAFKA_BOOTSTRAP"].rsplit(":", 1)[1]
    assert f"127.0.0.1:{kafka_port}:9092" in found["kafka"]["ports"]
    assert f"EXTERNAL://{exports['OUTBOXKIT_KAFKA_BOOTSTRAP']}" in (
        found["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"])
    migrate_url = found["migrate"]["environment"]["OUTBOXKIT_DATABASE_URL"]
    assert urlsplit(migrate_url).path == database.path
