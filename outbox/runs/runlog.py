"""A run's append-only log: entries written with the run's fenced checkpoint.

A worker that keeps a growing record (a durable agent's message history) saves only what is
new: ``save_checkpoint(..., log={seq: entry})`` writes those entries in the statement that
checks the lease, so a stale worker adds nothing, and a rolled-back save adds nothing either.
An entry written before may be written again (the newest one may still have changed: an
agent's request is completed when it is sent). The checkpoint says how many entries count
(:func:`read_log`'s *upto*): entries past it are from a save that is not the run's any more.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import CTE, Insert, Integer, Text, cast, func, literal, select
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import run_log
from outbox.errors import ConfigurationError
from outbox.runs.checkpoints import checked_json
from outbox.settings import OutboxSettings

Log = Mapping[int, Any]
"""Entries by sequence number (0-based, the order they are read back in)."""


def encoded(log: Log | None, settings: OutboxSettings | None) -> tuple[list[int], list[str]]:
    """The entries' sequence numbers and JSON texts, each checked against
    ``max_checkpoint_bytes`` (one entry is bounded like a checkpoint)."""
    if not log:
        return [], []
    seqs, texts = [], []
    for seq, entry in sorted(log.items()):
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ConfigurationError(f"a log entry's sequence number is an int >= 0, got {seq!r}")
        if entry is None:
            raise ConfigurationError(f"log entry {seq} is None: an entry is a JSON value")
        text = checked_json(entry, settings)
        assert text is not None
        seqs.append(seq)
        texts.append(text)
    return seqs, texts


def insert_from(seqs: list[int], texts: list[str]) -> Callable[[CTE], Insert]:
    """The log's INSERT for a fenced write (``fencing.statement(also=...)``): one row per
    entry for the run the write moved, none when it moved nothing."""

    def also(moved: CTE) -> Insert:
        rows = select(
            moved.c.id,
            func.unnest(literal(seqs, ARRAY(Integer))),
            cast(func.unnest(literal(texts, ARRAY(Text))), JSONB),
        )
        stmt = pg_insert(run_log).from_select(["run_id", "seq", "entry"], rows)
        return stmt.on_conflict_do_update(index_elements=[run_log.c.run_id, run_log.c.seq],
                                          set_={"entry": stmt.excluded.entry})

    return also


def read_plan(run_id: uuid.UUID, upto: int | None) -> Plan[list[Any]]:
    query = select(run_log.c.entry).where(run_log.c.run_id == run_id).order_by(run_log.c.seq)
    if upto is not None:
        query = query.where(run_log.c.seq < upto)
    rows = yield query
    return [row["entry"] for row in rows]


def read_log(conn: SyncConn, run_id: uuid.UUID, *, upto: int | None = None,
             settings: OutboxSettings | None = None) -> list[Any]:
    """The run's log entries in order (those numbered below *upto*, when given)."""
    return run_plan(conn, read_plan(run_id, upto), settings)
