"""README's first agent step and first consumer pass ``mypy --strict`` as written.

tests/e2e/test_examples.py runs them; this proves a user who pastes them into a strictly
typed project gets no error (``job.lease`` on a claim that may be ``None`` did not).
"""

from __future__ import annotations

import re
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"agent_step": "## One agent step", "consumer": "## An idempotent consumer"}


def python_block(readme: str, heading: str) -> tuple[int, str]:
    """The first python block after *heading*, and the README line its code starts on."""
    start = readme.index(heading)
    opening = readme.index("```python\n", start) + len("```python\n")
    closing = readme.index("```", opening)
    return readme.count("\n", 0, opening) + 1, readme[opening:closing]


def test_python_block_finds_the_code_and_its_line() -> None:
    readme = "# t\n\n## One agent step\n\ntext\n```python\nx = 1\n```\n"
    assert python_block(readme, "## One agent step") == (7, "x = 1\n")


def test_readme_examples_pass_mypy_strict(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    first_lines = {}
    for name, heading in SECTIONS.items():
        first_lines[name], code = python_block(readme, heading)
        (tmp_path / f"{name}.py").write_text(code)
    stdout, stderr, status = api.run([
        *(str(tmp_path / f"{name}.py") for name in SECTIONS),
        "--strict", "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(ROOT / ".mypy_cache"), "--no-error-summary",
    ])
    problems = []
    for line in stdout.splitlines():
        # "<tmp>/agent_step.py:12: error: ..." -> "README.md:<line in README>: error: ..."
        found = re.match(r".*?(\w+)\.py:(\d+):(.*)", line)
        if found and found.group(1) in first_lines:
            readme_line = first_lines[found.group(1)] + int(found.group(2)) - 1
            problems.append(f"README.md:{readme_line}:{found.group(3)}")
        else:
            problems.append(line)
    assert status == 0, "\n".join(problems) + stderr
