"""Each operator command group on a database without the outboxkit schema says to migrate it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.cli_support import one_line, outbox
from tests.integration.databases import fresh_database

# Fixed ids: parallel test workers must collect the same test names.
RUN_ID = "3431dabb-7d91-41a5-b9f8-12a3f37fe7b9"
COMMANDS = [
    ("runs", "show", RUN_ID),
    ("messages", "retry", "--all-failed"),
    ("dlq", "list"),
    ("ops", "resolve", RUN_ID, "--not-applied", "--reason", "r", "--actor", "a"),
    ("purge", "--dry-run"),
]


@pytest.fixture(scope="module")
def empty_url(postgres_dsn: str) -> Iterator[str]:
    with fresh_database(postgres_dsn) as url:
        yield url


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_says_run_outbox_migrate_in_one_line(args: tuple[str, ...], empty_url: str) -> None:
    result = outbox(*args, "--database-url", empty_url)
    assert result.returncode == 1
    assert "run `outbox migrate`" in one_line(result)
