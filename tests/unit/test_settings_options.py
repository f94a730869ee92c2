"""``settings_options``: the daemons' commands take one option per setting; the settings class,
not click, reads the environment and checks every value."""

from __future__ import annotations

from typing import Literal

import click
import pytest
from click.testing import CliRunner, Result
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox.cli.daemon import EXIT_CONFIG
from outbox.cli.flags import settings_options


class Sample(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SAMPLE_", frozen=True)

    batch_size: int = Field(default=10, ge=1, description="Rows per batch.")
    mode: Literal["fast", "safe"] = Field(default="safe", description="How to go.")
    check: bool = Field(default=True, description="Check things.")
    limit: float | None = Field(default=None, description="Optional.")


@click.command("sample")
@click.argument("target")
@settings_options(Sample)
def sample_command(target: str, settings: Sample) -> None:
    click.echo(f"{target} {settings.batch_size} {settings.mode} {settings.check} {settings.limit}")


@click.group("daemon", invoke_without_command=True)
@settings_options(Sample, prog="daemon")
def daemon_group(settings: Sample) -> None:
    click.echo(f"daemon runs with {settings.batch_size}")


@daemon_group.command("sub")
def sub_command() -> None:
    click.echo("sub runs")


@pytest.fixture(autouse=True)
def no_sample_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SAMPLE_BATCH_SIZE", "SAMPLE_MODE", "SAMPLE_CHECK", "SAMPLE_LIMIT"):
        monkeypatch.delenv(name, raising=False)


def run(command: click.Command, *argv: str, **env: str) -> Result:
    return CliRunner().invoke(command, list(argv), env=env)


class TestOptions:
    def test_one_option_per_setting_in_the_class_order_with_its_variable_in_the_help(
        self,
    ) -> None:
        names = [p.opts[0] for p in sample_command.params if isinstance(p, click.Option)]
        assert names == ["--batch-size", "--mode", "--check", "--limit"]
        shown = " ".join(run(sample_command, "--help").stdout.split())
        assert "--batch-size INTEGER Rows per batch. (env SAMPLE_BATCH_SIZE)" in shown
        assert "--mode [fast|safe]" in shown
        assert "--check / --no-check" in shown

    def test_without_options_the_environment_and_the_defaults_apply(self) -> None:
        done = run(sample_command, "t", SAMPLE_MODE="fast")
        assert done.exit_code == 0, done.output
        assert done.stdout == "t 10 fast True None\n"

    def test_an_option_given_wins_over_the_environment(self) -> None:
        done = run(sample_command, "t", "--batch-size", "5", "--no-check", "--limit", "2.5",
                   SAMPLE_BATCH_SIZE="7")
        assert done.exit_code == 0, done.output
        assert done.stdout == "t 5 safe False 2.5\n"


class TestErrors:
    def test_a_bad_option_is_one_line_naming_the_variable_and_the_option_and_exit_2(
        self,
    ) -> None:
        done = run(sample_command, "t", "--mode", "reckless")
        assert done.exit_code == EXIT_CONFIG
        assert done.stderr.splitlines() == [
            "sample: invalid setting mode (env SAMPLE_MODE, flag --mode): Input should be "
            "'fast' or 'safe' (got 'reckless')"
        ]

    def test_a_bad_variable_is_reported_the_same_way_after_the_prog_given(self) -> None:
        done = run(daemon_group, SAMPLE_BATCH_SIZE="0")
        assert done.exit_code == EXIT_CONFIG
        assert done.stderr.startswith("daemon: invalid setting batch_size (env SAMPLE_BATCH_SIZE")
        assert len(done.stderr.splitlines()) == 1


class TestOnAGroup:
    def test_a_subcommand_runs_without_the_groups_settings(self) -> None:
        done = run(daemon_group, "sub", SAMPLE_BATCH_SIZE="0")  # would be refused
        assert done.exit_code == 0, done.output
        assert done.stdout == "sub runs\n"

    def test_the_groups_options_before_a_subcommand_are_a_usage_error(self) -> None:
        done = run(daemon_group, "--batch-size", "3", "sub")
        assert done.exit_code == 2
        assert "--batch-size: options of `daemon` itself, not of `sub`" in done.stderr

    def test_without_a_subcommand_the_group_runs_with_its_settings(self) -> None:
        done = run(daemon_group, "--batch-size", "3")
        assert done.exit_code == 0, done.output
        assert done.stdout == "daemon runs with 3\n"
