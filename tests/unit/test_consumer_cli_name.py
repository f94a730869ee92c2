"""The consumer's help and errors name the command the user typed: ``outbox consume`` or
``python -m consumers``, never a bare ``consumers`` that runs nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=environ, check=False)


def test_outbox_consume_help_shows_outbox_consume() -> None:
    done = run("-m", "outbox.cli", "consume", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: outbox consume [-h]")
    assert "module:attribute" in done.stdout
    assert "--max-attempts" in done.stdout


def test_python_m_consumers_help_shows_how_it_was_run() -> None:
    done = run("-m", "consumers", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m consumers [-h]")


def test_outbox_consume_errors_name_outbox_consume() -> None:
    missing = run("-m", "outbox.cli", "consume")
    assert missing.returncode == 2
    assert "usage: outbox consume" in missing.stderr
    assert "outbox consume: error: the following arguments are required: app" in missing.stderr
    wrong = run("-m", "outbox.cli", "consume", "os:path")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        "outbox consume: 'os:path' is not a consumers.Consumer (got module)"
    ]
