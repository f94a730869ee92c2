"""docs/configuration.md is generated from the settings classes and must match them."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Literal

import click
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.commands import consume_command
from consumers.settings import ConsumerSettings
from outbox.settings import OutboxSettings
from relay.commands import relay_command
from relay.settings import RelaySettings
from tools.settings_docs import REGENERATE, settings_table

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def test_the_committed_reference_is_what_the_settings_classes_give() -> None:
    render = runpy.run_path(str(ROOT / "scripts" / "gen_config_docs.py"))["render"]
    assert DOC.read_text() == render(), (
        f"docs/configuration.md is stale: regenerate it with `{REGENERATE}` and commit it"
    )


def test_every_setting_is_documented_with_its_environment_variable() -> None:
    text = DOC.read_text()
    for cls in (OutboxSettings, RelaySettings, ConsumerSettings):
        prefix = cls.model_config["env_prefix"]
        for name in cls.model_fields:
            assert f"`{prefix}{name.upper()}`" in text, (cls.__name__, name)


def flags(command: click.Command) -> set[str]:
    return {option for param in command.params for option in param.opts + param.secondary_opts}


def test_every_documented_flag_is_one_the_daemon_takes() -> None:
    for cls, command in ((RelaySettings, relay_command), (ConsumerSettings, consume_command)):
        table = settings_table([cls])
        documented = {cell.strip("`") for row in table.splitlines()[2:]
                      for cell in row.split(" | ")[1].split(" / ")}
        assert documented <= flags(command), documented - flags(command)


class Sample(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="APP_")

    mode: Literal["a", "b"] = Field(default="a", description="Pick | one.")
    token: SecretStr = Field(default=SecretStr("do-not-print"), description="A secret.")
    limit: float | None = Field(default=None, description="Optional.")
    fast: bool = Field(default=False, description="Go\n  fast.")
    name: str = Field(default_factory=lambda: "x")


def test_a_table_row_per_setting_with_type_default_and_description() -> None:
    assert settings_table([Sample]).splitlines() == [
        "| environment variable | flag | type | default | what it does |",
        "|---|---|---|---|---|",
        "| `APP_MODE` | `--mode` | `a` \\| `b` | `a` | Pick \\| one. |",
        "| `APP_TOKEN` | `--token` | secret text | hidden | A secret. |",
        "| `APP_LIMIT` | `--limit` | float (optional) | unset | Optional. |",
        "| `APP_FAST` | `--fast` / `--no-fast` | bool | `false` | Go fast. |",
        "| `APP_NAME` | `--name` | text | computed |  |",
    ]


def test_without_flags_the_column_is_left_out() -> None:
    assert settings_table([Sample], ["mode"], flags=False).splitlines()[2] == (
        "| `APP_MODE` | `a` \\| `b` | `a` | Pick \\| one. |"
    )
