"""The console's reads use indexes, not whole tables: with sequential scans made as dear as
the planner allows, no statement of the runs list (all, by state, a deep page, by id), the
inbox or a run's page reads a big table whole (a sequential scan, or a whole index with no
condition and no LIMIT)."""

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


def _whole_table_reads(conn: Connection, sent: list[tuple[str, Any]]) -> list[str]:
    """Each big table read whole: a sequential scan, or an index scanned with no condition
    on it and no LIMIT above (reading the index in order to stop after a page is fine)."""
    found: list[str] = []

    def walk(node: dict[str, Any], limited: bool, statement: str) -> None:
        limited = limited or node["Node Type"] == "Limit"
        table = node.get("Relation Name")
        if table in BIG:
            kind = node["Node Type"]
            if kind == "Seq Scan" or (kind in ("Index Scan", "Index Only Scan")
                                      and "Index Cond" not in node and not limited):
                found.append(f"{kind} on {table} ({node.get('Index Name')}): "
                             f"{statement[:100]}")
        if node["Node Type"] == "Bitmap Heap Scan" and table in BIG:
            inner = node["Plans"][0]
            if "Index Cond" not in inner:
                found.append(f"bitmap scan of all of {table}: {statement[:100]}")
        for child in node.get("Plans", []):
            walk(child, limited, statement)

    raw = conn.connection.dbapi_connection
    assert raw is not None
    with raw.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        for statement, parameters in sent:
            cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
            walk(cursor.fetchone()[0][0]["Plan"], False, statement)
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
        # Outbox rows, a few of them the run's: what the planner sees in a real outbox (an
        # empty table is read whole whatever the indexes).
        conn.execute(text(
            "INSERT INTO outboxkit.outbox_messages (message_id, topic, lane, message_type, "
            "payload, run_id) SELECT gen_random_uuid(), 't', g % 64, 't', '', "
            "CASE WHEN g <= 3 THEN CAST(:run AS uuid) END FROM generate_series(1, 3000) AS g"),
            {"run": runs[10].id})
        conn.execute(text("ANALYZE"))
    captured.clear()
    with engine.connect() as conn:
        read(conn, runs[10])
        sent = list(captured)
        assert sent, "nothing was read"
        assert _whole_table_reads(conn, sent) == []

