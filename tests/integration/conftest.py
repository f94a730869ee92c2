"""Fixtures shared by the agent-run integration tests (real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event

from outbox.db.tables import metadata


@pytest.fixture
def runs_engine(engine: Engine) -> Engine:
    """The per-test engine on the migrated template database (the name the agent-run tests
    use; the migrations create every run table, run_archive included)."""
    return engine


RUN_TABLES = ("agent_runs", "run_transitions", "step_results", "approvals", "artifacts")


Snapshot = Callable[[], dict[str, list[tuple[object, ...]]]]


@pytest.fixture
def snapshot(runs_engine: Engine) -> Snapshot:
    """Every row of the run tables, in a stable order: compare two to prove nothing changed."""

    def take() -> dict[str, list[tuple[object, ...]]]:
        with runs_engine.connect() as conn:
            return {
                name: sorted(
                    (tuple(row) for row in conn.execute(metadata.tables[f"outboxkit.{name}"]
                                                        .select())),
                    key=repr,
                )
                for name in RUN_TABLES
            }

    return take


@pytest.fixture
def statements(engine: Engine) -> Iterator[list[str]]:
    """Every SQL statement the engine sends, in order."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    yield sent
    event.remove(engine, "before_cursor_execute", record)
