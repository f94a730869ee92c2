"""Every code block of README.md and docs/*.md runs as written, so the docs never rot.

A ```python block runs as a script of its own, in a fresh Python process (some blocks patch
or reproduce bugs of kafka-python, which must not see another block's imports), against a
migrated database and Kafka: the placeholder addresses the docs show are swapped for the
test's, and ``OUTBOXKIT_DATABASE_URL`` / ``OUTBOXKIT_KAFKA_BOOTSTRAP`` point at them. A
block that goes on from the one before it in its file says so right above it,
``<!-- after the block above -->``, and runs after it in the same script. A block that
cannot run at all (a part of someone else's file) says so too, ``<!-- not-run: why -->``,
and ``NOT_RUN`` below counts them, so they stay few. Running proves little about a
function's body that no block calls, so every name a block uses must also be defined or
imported (pyflakes' undefined-name check, through ruff). A block that defines ``test_``
functions runs under pytest, with the fixtures of outboxkit's plugin.

Shell blocks are checked against the command line: every ``outbox ...`` command they (and
the prose's inline code) show exists, with every ``--option`` shown.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import psycopg
import pytest
from click.testing import CliRunner

from outbox.cli.main import main as outbox_cli
from outbox.db.dsn import sqlalchemy_url, with_database

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Blocks marked `<!-- not-run: why -->`, per file. Adding one means adding it here.
NOT_RUN = {
    "docs/alembic.md": 2,  # an Alembic revision and env.py: they need Alembic's context
    "docs/operations.md": 1,  # kafka-python bug 2, reproduction A: a minute of group joins
}

_FENCE = re.compile(r"^```(\S*)\s*$")
_NOT_RUN = re.compile(r"^<!-- not-run: (.+?) -->$")
_AFTER = "<!-- after the block above -->"
_TESTS = re.compile(r"^(?:async )?def test_", re.M)


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it starts, its language, and the marker above it."""

    doc: str  # path relative to the repository root
    line: int  # the opening fence's line, 1-based
    language: str
    code: str
    not_run: str | None  # the reason given by a `<!-- not-run: ... -->` right above it
    after: Block | None  # the block this one goes on from (`<!-- after the block above -->`)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def script(self) -> str:
        """The code that runs: the blocks this one goes on from, then this one."""
        return (self.after.script if self.after else "") + self.code


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        above = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        marker = _NOT_RUN.match(above)
        if above == _AFTER:
            assert found, f"{path}:{index + 1}: no block above to go on from"
        found.append(Block(doc=str(path.relative_to(ROOT)), line=index + 1,
                           language=opening.group(1), code="\n".join(lines[index + 1:end]) + "\n",
                           not_run=marker.group(1) if marker else None,
                           after=found[-1] if above == _AFTER else None))
        index = end + 1
    return found


def _prose(path: Path) -> str:
    """The text of *path* without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


ALL_BLOCKS = [block for path in DOCS for block in _blocks(path)]
PYTHON = [block for block in ALL_BLOCKS if block.language.startswith("py")]
SHELL = [block for block in ALL_BLOCKS if block.language in {"sh", "bash", "shell", "console"}]


RUNNABLE = [block for block in PYTHON if block.not_run is None]


class _Blocks:
    """Runs blocks, each in its own process on a fresh migrated database."""

    def __init__(self, postgres_dsn: str, template: str, kafka_bootstrap: str,
                 directories: pytest.TempPathFactory) -> None:
        self.postgres_dsn, self.template = postgres_dsn, template
        self.kafka_bootstrap, self.directories = kafka_bootstrap, directories
        self.started: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.databases: list[str] = []

    def start(self, block: Block) -> None:
        if block.where in self.started:
            return
        name = f"t_docs_{uuid.uuid4().hex[:10]}"
        _admin(self.postgres_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        self.databases.append(name)
        self.started[block.where] = _start(
            block, self.postgres_dsn, with_database(self.postgres_dsn, name),
            self.kafka_bootstrap, self.directories.mktemp("block"),
        )

    def close(self) -> None:
        for process, _ in self.started.values():
            if process.poll() is None:
                process.kill()
            process.wait()
        for name in self.databases:
            _admin(self.postgres_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def blocks(request: pytest.FixtureRequest, postgres_dsn: str, outboxkit_template: str,
           kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Blocks]:
    """In one process, every selected block starts at once: most of their time is waiting
    (imports, Kafka's group protocol, the reproductions' own timeouts), so together they
    take about as long as the slowest one. Under pytest-xdist each test starts its own
    block, as the workers already run tests side by side (a worker cannot tell which of
    the blocks it will be given)."""
    runner = _Blocks(postgres_dsn, outboxkit_template, kafka_bootstrap, tmp_path_factory)
    try:
        if "PYTEST_XDIST_WORKER" not in os.environ:
            selected = {getattr(item, "callspec").params["block"].where  # noqa: B009
                        for item in request.session.items
                        if getattr(item, "originalname", "") == "test_the_python_block_runs"}
            for block in RUNNABLE:
                if block.where in selected:
                    runner.start(block)
        yield runner
    finally:
        runner.close()


def _admin(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement.encode())  # our own uuid-based database names


def _start(block: Block, postgres_dsn: str, database_url: str, kafka_bootstrap: str,
           directory: Path) -> tuple[subprocess.Popen[bytes], Path]:
    # The addresses the docs show, and what stands for them here.
    code = (block.script
            .replace("postgresql+psycopg://app@db/app", sqlalchemy_url(database_url))
            .replace("127.0.0.1:9092", kafka_bootstrap))
    script = directory / "test_block.py"
    script.write_text(code)
    env = {**os.environ, "OUTBOXKIT_DATABASE_URL": database_url,
           "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap,
           "OUTBOXKIT_TEST_DATABASE_URL": postgres_dsn,
           "OUTBOXKIT_TEST_KAFKA_BOOTSTRAP": kafka_bootstrap}
    # A block that shows tests of your own runs under pytest, with outboxkit's plugin.
    runner = ["-m", "pytest", "-q", "-p", "no:cacheprovider"] if _TESTS.search(code) else []
    output = directory / "output.txt"
    with output.open("wb") as sink:  # a file, not a pipe: nobody reads until the block ends
        process = subprocess.Popen([sys.executable, *runner, str(script)], cwd=directory,
                                   env=env, stdout=sink, stderr=subprocess.STDOUT)
    return process, output


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.where)
def test_the_python_block_runs(block: Block, blocks: _Blocks) -> None:
    blocks.start(block)
    process, output = blocks.started[block.where]
    try:
        process.wait(timeout=180)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    assert process.returncode == 0, (
        f"the block at {block.where} failed:\n{output.read_text(errors='replace')}"
    )


def test_every_name_a_python_block_uses_is_defined(tmp_path: Path) -> None:
    for number, block in enumerate(PYTHON):
        if block.not_run is None:
            (tmp_path / f"block_{number}.py").write_text(block.script)
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache",
         "--select", "F821,F822,F823", "--output-format", "concise", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    where = {f"block_{number}.py": block.where for number, block in enumerate(PYTHON)}
    report = re.sub(r"\S*(block_\d+\.py)", lambda m: where[m.group(1)], result.stdout)
    assert result.returncode == 0, f"names used and never defined:\n{report}"


def test_the_blocks_not_run_are_few_and_say_why() -> None:
    marked: dict[str, int] = {}
    for block in PYTHON:
        if block.not_run is not None:
            assert block.not_run.strip(), f"{block.where}: say why it is not run"
            marked[block.doc] = marked.get(block.doc, 0) + 1
    assert marked == NOT_RUN


def test_every_not_run_marker_sits_above_a_python_block() -> None:
    """A marker whose block moved away would silently stop excusing anything."""
    for path in DOCS:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if _NOT_RUN.match(line.strip()):
                following = next((text for text in lines[number + 1:] if text.strip()), "")
                assert following.startswith("```py"), (
                    f"{path.relative_to(ROOT)}:{number + 1}: not-run marker without its block"
                )


# `outbox` followed by its words, in a shell line or in the prose's inline code.
_SHELL_COMMAND = re.compile(r"(?:^|[\s;(`'\"=])outbox((?: +[^\s#`]+)*)")
_INLINE_COMMAND = re.compile(r"`outbox ([^`]+)`")


def _command_lines() -> list[tuple[str, str]]:
    """(where, the words after ``outbox``) for every command the docs show."""
    shown: list[tuple[str, str]] = []
    for block in SHELL:
        for offset, line in enumerate(block.code.splitlines(), start=1):
            command = line.split(" #")[0]
            for match in _SHELL_COMMAND.finditer(command):
                words = match.group(1).strip()
                if words and not words.startswith(("-", ".")):
                    shown.append((f"{block.doc}:{block.line + offset}", words))
    for path in DOCS:
        shown += [(str(path.relative_to(ROOT)), match.group(1))
                  for match in _INLINE_COMMAND.finditer(_prose(path))]
    return shown


def _resolve(words: str) -> list[tuple[list[str], click.Command]]:
    """The commands ``outbox <words>`` names: ``list|show`` names both."""
    paths: list[tuple[list[str], click.Command]] = [([], outbox_cli)]
    for word in words.split():
        group_paths = [(p, c) for p, c in paths if isinstance(c, click.Group)]
        if not group_paths or not re.fullmatch(r"[a-z][a-z-]*(\|[a-z][a-z-]*)*", word):
            break
        ctx = click.Context(outbox_cli)
        paths = []
        for path, group in group_paths:
            assert isinstance(group, click.Group)
            for name in word.split("|"):
                command = group.get_command(ctx, name)
                assert command is not None, f"`outbox {' '.join([*path, name])}` does not exist"
                paths.append(([*path, name], command))
    return paths


@pytest.mark.parametrize(("where", "words"), _command_lines(),
                         ids=[f"{where} {words}" for where, words in _command_lines()])
def test_the_command_shown_exists_with_its_options(where: str, words: str) -> None:
    resolved = _resolve(words)
    assert resolved[0][0], f"{where}: `outbox {words}` names no command"
    options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", words))
    known: set[str] = set()
    for path, command in resolved:
        result = CliRunner().invoke(outbox_cli, [*path, "--help"])
        assert result.exit_code == 0, f"{where}: outbox {' '.join(path)} --help: {result.output}"
        for param in command.params:
            known.update(param.opts + param.secondary_opts)
        # What the help shows counts too (e.g. the --no-x of a --x/--no-x option).
        known.update(re.findall(r"--[a-z][a-z0-9-]*", result.output))
    assert options <= known, f"{where}: `outbox {words}`: no option {sorted(options - known)}"


def test_every_repository_path_the_docs_name_exists() -> None:
    """A renamed or removed file leaves no reference behind (relative to the root or the doc)."""
    named = re.compile(r"(?<![\w./-])((?:outbox|relay|consumers|dedup|tests|examples|bench|"
                       r"scripts|docs)/[\w/.-]*\w)")
    missing = [f"{path.relative_to(ROOT)}: {match.group(1)}"
               for path in DOCS for match in named.finditer(path.read_text())
               if not (ROOT / match.group(1)).exists()
               and not (path.parent / match.group(1)).exists()]
    assert missing == []


def _library_source() -> str:
    return "".join(path.read_text() for package in ("outbox", "relay", "consumers", "dedup")
                   for path in (ROOT / package).rglob("*.py"))


def test_every_dotted_name_the_prose_shows_exists() -> None:
    """`outbox.aio.emit`, `relay.roles.relay_grants`: each imports, or (a span's or a
    failpoint's or a figure's name) is a string the library or the bench uses, so a rename
    leaves no stale name."""
    # A benchmark figure's name (`outbox.worker_steps_per_s`) is a string the bench uses.
    source = _library_source() + "".join(p.read_text() for p in (ROOT / "bench").rglob("*.py"))
    stale = []
    for path in DOCS:
        for match in re.finditer(r"`((?:outbox|relay|consumers|dedup)(?:\.[A-Za-z_]\w*)+)",
                                 _prose(path)):
            name = match.group(1)
            if not _resolves(name) and f'"{name}"' not in source:
                stale.append(f"{path.relative_to(ROOT)}: {name}")
    assert stale == []


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_the_architecture_lists_every_table_and_view() -> None:
    created = set()
    for migration in (ROOT / "outbox" / "db" / "migrations").glob("*.sql"):
        created |= set(re.findall(r"CREATE (?:UNLOGGED )?(?:TABLE|VIEW) \{schema\}\.(\w+)",
                                  migration.read_text()))
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    tables = architecture.split("## Tables", 1)[1].split("\n## ", 1)[0]
    assert created, "no CREATE TABLE found: did the migrations' spelling change?"
    assert sorted(name for name in created if f"`{name}`" not in tables) == []
