"""The README's agent example type-checks with ``mypy --strict`` as written: the checkpoint's
type flows from ``ClaimedRun[Order]`` to ``job.checkpoint`` (test_docs_code.py runs it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## One agent step"


def agent_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(HEADING):]
    found = re.search(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert found, f"no python block under {HEADING!r} in README.md"
    return found.group(1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for both tests: the second checks only the example again (outboxkit
    and its dependencies, most of the 15 s of a cold run, come from the cache)."""
    return tmp_path_factory.mktemp("mypy_cache")


def mypy(source: str, directory: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    (directory / "example.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
         "--cache-dir", str(cache), "--config-file", "/dev/null",
         str(directory / "example.py")],
        cwd=directory, capture_output=True, text=True, check=False, timeout=300)


def test_the_readme_agent_example_passes_mypy_strict(tmp_path: Path, cache: Path) -> None:
    source = agent_example()
    assert "ClaimedRun[Order]" in source
    result = mypy(source, tmp_path, cache)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checkpoint_is_typed_so_a_wrong_use_is_caught(tmp_path: Path, cache: Path) -> None:
    """The check can fail: a misuse of the typed checkpoint is an error."""
    wrong = agent_example().replace("order.qty}", "order.quantity}", 1)
    assert wrong != agent_example()
    result = mypy(wrong, tmp_path, cache)
    assert result.returncode == 1
    assert '"Order" has no attribute "quantity"' in result.stdout
