"""The consumer's command line, run in this process (click's CliRunner, for ``outbox consume``
and for the same command as ``python -m consumers``): help and errors name the command the
user typed, never a bare ``consumers`` that runs nothing, and a bad setting is one line, exit 2."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from consumers.commands import consume_command
from outbox.cli.main import main as outbox_main


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str


@pytest.fixture(autouse=True)
def as_a_user_runs_it(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OUTBOXKIT_ variable of the test session, and the root logger put back afterwards
    (the commands configure logging, as a process of their own would)."""
    for name in [n for n in os.environ if n.startswith("OUTBOXKIT_")]:
        monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def outbox(*argv: str, **env: str) -> Ran:
    result = CliRunner().invoke(outbox_main, list(argv), env=env)
    return Ran(result.exit_code, result.stdout, result.stderr)


def python_m_consumers(*argv: str, **env: str) -> Ran:
    """What ``python -m consumers`` runs (its ``__main__`` calls this command), as it names
    itself there (the next test checks that naming in a real ``python -m consumers``)."""
    result = CliRunner().invoke(consume_command, list(argv), env=env,
                                prog_name="python -m consumers")
    return Ran(result.exit_code, result.stdout, result.stderr)


def test_outbox_consume_help_shows_outbox_consume() -> None:
    done = outbox("consume", "--help")
    assert done.code == 0, done.stderr
    assert done.stdout.startswith("Usage: outbox consume [OPTIONS] MODULE:APP")
    assert "module:attribute" in done.stdout
    assert "--max-attempts" in done.stdout


def test_python_m_consumers_help_shows_how_it_was_run() -> None:
    done = subprocess.run([sys.executable, "-m", "consumers", "--help"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: python -m consumers [OPTIONS] MODULE:APP")


def test_outbox_consume_without_an_app_names_outbox_consume() -> None:
    missing = outbox("consume")
    assert missing.code == 2
    assert "Usage: outbox consume" in missing.stderr
    assert "Error: Missing argument 'MODULE:APP'." in missing.stderr


@pytest.mark.parametrize("run", [outbox, python_m_consumers], ids=["outbox", "python-m"])
def test_an_app_path_that_is_not_a_consumer_is_one_line_naming_the_command_and_exit_2(
    run: object,
) -> None:
    prog = "outbox consume" if run is outbox else "python -m consumers"
    argv = ["consume", "os:path"] if run is outbox else ["os:path"]
    done = run(*argv, OUTBOXKIT_CONSUMER_DATABASE_URL="postgresql://x@h/d")  # type: ignore[operator]
    assert done.code == 2
    assert done.stderr.strip().splitlines() == [
        f"{prog}: 'os:path' is not a consumers.Consumer (got module)"
    ]


def test_a_bad_setting_is_one_line_naming_env_and_flag_and_exit_2() -> None:
    done = python_m_consumers("tests.e2e.consumer_app:app", OUTBOXKIT_CONSUMER_MAX_ATTEMPTS="zero")
    assert done.code == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "OUTBOXKIT_CONSUMER_MAX_ATTEMPTS" in lines[0]
    assert "--max-attempts" in lines[0]


@pytest.mark.parametrize("run", [outbox, python_m_consumers], ids=["outbox", "python-m"])
def test_a_bad_flag_value_is_one_line_and_exit_2(run: object) -> None:
    argv = ["tests.e2e.consumer_app:app", "--max-attempts", "-1"]
    done = run(*(["consume", *argv] if run is outbox else argv))  # type: ignore[operator]
    assert done.code == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "invalid setting max_attempts" in done.stderr


def test_the_command_runs_the_consumer_as_a_process_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What lets the runner tune the interpreter for it (switch_interval_ms)."""
    made: list[dict[str, object]] = []

    def run_daemon(prog: str, make: Callable[[], object], settings: object) -> int:
        make()
        return 0

    monkeypatch.setattr("consumers.commands.run_daemon", run_daemon)
    monkeypatch.setattr("consumers.commands.Runner",
                        lambda app, **options: made.append(options))
    done = python_m_consumers("tests.e2e.consumer_app:app")
    assert done.code == 0, done.stderr
    assert made == [{"own_process": True}]


@pytest.mark.parametrize(("given", "client", "own_process", "expected"), [
    (None, "kafka-python", True, 0.5),
    (None, "confluent", True, None),  # librdkafka parses without the interpreter's lock
    (None, "kafka-python", False, None),  # embedded: the program's interpreter, left alone
    (2.0, "confluent", False, 2.0),  # asked for
])
def test_the_switch_interval_a_runner_sets(
    given: float | None, client: str, own_process: bool, expected: float | None
) -> None:
    from consumers.runner import switch_interval_ms  # noqa: PLC0415
    from consumers.settings import ConsumerSettings  # noqa: PLC0415

    settings = ConsumerSettings(switch_interval_ms=given, kafka_client=client)
    assert switch_interval_ms(settings, own_process=own_process) == expected


def test_the_runner_sets_the_switch_interval_and_gives_back_the_one_before() -> None:
    from consumers.runner import _switch_interval  # noqa: PLC0415

    before = sys.getswitchinterval()
    try:
        assert _switch_interval(None) is None
        assert sys.getswitchinterval() == before
        assert _switch_interval(0.5) == pytest.approx(before * 1000)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
