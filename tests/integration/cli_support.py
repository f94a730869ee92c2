"""Running the `outbox` command line as a user does: a subprocess with a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys


def outbox(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return subprocess.run([sys.executable, "-m", "outbox.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **env}, check=False)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The error a command printed, asserting it is a single line."""
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr
