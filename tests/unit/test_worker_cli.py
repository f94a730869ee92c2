"""``outbox worker``: what it refuses before starting, in one line with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTBOX = Path(sys.executable).parent / "outbox"


def worker(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(OUTBOX), "worker", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**os.environ, "OUTBOXKIT_DATABASE_URL": "postgresql://u@h/db",
                               **env})


def test_an_app_path_that_is_not_an_app_is_named() -> None:
    result = worker("tests.integration.worker_app:nap")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "outbox worker: 'tests.integration.worker_app:nap' is not an outbox.App (got function)"]


def test_a_bad_setting_names_its_variable_and_flag() -> None:
    result = worker("tests.integration.worker_app:app", OUTBOXKIT_WORKER_LEASE_SECONDS="0")
    assert result.returncode == 2
    assert result.stderr.startswith("outbox worker: invalid setting lease_seconds "
                                    "(env OUTBOXKIT_WORKER_LEASE_SECONDS, flag --lease-seconds): ")
    result = worker("tests.integration.worker_app:app", "--name", "")
    assert result.returncode == 2
    assert result.stderr.startswith("outbox worker: invalid setting name "
                                    "(env OUTBOXKIT_WORKER_NAME, flag --name): ")
