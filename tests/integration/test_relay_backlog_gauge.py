"""The relay's backlog gauge: exact up to its cap of rows a lane, estimated past it, and a
refresh reads at most the cap a lane whatever the backlog (relay/queries.sql: backlog)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from relay.metrics import read_backlog
from tests.integration.relay_support import Reader, pool_of, put


def fill(engine: Engine, n: int, *, transactions: int = 10) -> None:
    for t in range(transactions):
        with engine.begin() as conn:
            for i in range(t, n, transactions):
                put(conn, f"k{i % 37}", i)


def gauge(engine: Engine, cap: int) -> tuple[Any, int]:
    """The gauge's row and how many outbox rows its read fetched (the transaction's own
    statistics, read before it ends)."""
    pool = pool_of(engine)
    try:
        with pool.begin() as conn:
            jit = conn.execute("SHOW jit").fetchone()[0]
            row = read_backlog(conn, "outboxkit", lanes=1, cap=cap)
            # The transaction's planner as it was (the console's overview reads on after it).
            assert conn.execute("SHOW enable_bitmapscan").fetchone()[0] == "on"
            assert conn.execute("SHOW jit").fetchone()[0] == jit
            fetched = conn.execute(
                "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_xact_user_tables"
                " WHERE schemaname = 'outboxkit' AND relname = 'outbox_messages'"
            ).fetchone()
        return row, fetched[0] if fetched else 0
    finally:
        pool.close()


def test_exact_below_the_cap_and_after_a_batch(engine: Engine) -> None:
    reader = Reader(engine, limit=30)
    fill(engine, 100)
    row, _ = gauge(engine, cap=256)
    assert row.backlog == 100
    assert row.oldest_age >= 0
    assert len(reader.step()) == 30
    row, _ = gauge(engine, cap=256)
    assert row.backlog == 70


def test_estimated_past_the_cap_from_a_bounded_read(engine: Engine) -> None:
    reader = Reader(engine, limit=500)
    fill(engine, 3000)
    row, fetched = gauge(engine, cap=100)
    # A lane's ids are spread evenly: here every id is this one lane's, so the estimate is
    # all but exact; the read stopped at the cap, far from the 3,000 rows.
    assert abs(row.backlog - 3000) <= 30, row.backlog
    assert fetched <= 110, fetched
    assert len(reader.step()) == 500
    row, _ = gauge(engine, cap=100)
    assert abs(row.backlog - 2500) <= 25, row.backlog
    reader.drain()
    row, fetched = gauge(engine, cap=100)
    assert (row.backlog, row.oldest_age) == (0, 0)


def test_rows_of_a_transaction_running_at_the_cursor_are_counted(engine: Engine) -> None:
    reader = Reader(engine)
    late = engine.connect()
    try:
        with late.begin():
            for i in range(5):
                put(late, "late", i)
            fill(engine, 20, transactions=2)
            assert len(reader.drain()) == 20  # the cursor is taken while `late` runs
        row, _ = gauge(engine, cap=256)
        assert row.backlog == 5  # behind the cursor by id, after it by commit
    finally:
        late.close()
