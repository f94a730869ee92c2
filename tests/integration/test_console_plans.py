"""The console's lists read indexes, not the whole table: with sequential scans made as dear
as the planner allows, each statement of the runs list (all, by state, a deep page, by id),
the inbox and a run's page still plans without one on the big tables."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, text

from console import reads
from outbox.runs.lifecycle import start_run
from outbox.settings import OutboxSettings

BIG = ("agent_runs", "outbox_messages", "operations", "run_transitions", "approvals")


@pytest.fixture
def captured(engine: Engine) -> Iterator[list[tuple[str, Any]]]:
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    yield sent
    event.remove(engine, "before_cursor_execute", record)


def _seq_scans(conn: Connection, sent: list[tuple[str, Any]]) -> list[str]:
    found = []
    raw = conn.connection.dbapi_connection
    assert raw is not None
    with raw.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        for statement, parameters in sent:
            cursor.execute("EXPLAIN " + statement, parameters)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            found += [f"{table}: {statement[:120]}" for table in BIG
                      if f"Seq Scan on {table}" in plan]
        cursor.execute("RESET enable_seqscan")
    return found


@pytest.mark.parametrize("read", [
    lambda c, run: reads.runs_page(c, limit=5),
    lambda c, run: reads.runs_page(c, state="failed", limit=5),
    lambda c, run: reads.runs_page(c, before=reads.encode_cursor(run.created_at, run.id),
                                   limit=5),
    lambda c, run: reads.runs_page(c, state="queued",
                                   before=reads.encode_cursor(run.created_at, run.id), limit=5),
    lambda c, run: reads.runs_page(c, search=str(run.id), limit=5),
    lambda c, run: reads.run_page(c, run.id, OutboxSettings()),
    lambda c, run: reads.inbox(c, OutboxSettings()),
], ids=["runs", "runs-by-state", "deep-page", "deep-page-by-state", "run-id", "run-page",
        "inbox"])
def test_the_consoles_reads_use_indexes(engine: Engine, captured: list[tuple[str, Any]],
                                        read: Callable[[Connection, Any], Any]) -> None:
    with engine.begin() as conn:
        runs = [start_run(conn, workflow="wf", workflow_version="1",
                          idempotency_key=f"plan-{i}") for i in range(20)]
        conn.execute(text("ANALYZE"))
    captured.clear()
    with engine.connect() as conn:
        read(conn, runs[10])
        sent = list(captured)
        assert sent, "nothing was read"
        assert _seq_scans(conn, sent) == []

