"""Retention: drop the checkpoints, step results, logs and events of long-finished runs, in
batches.

What stays: the run row (state, evidence, the idempotency key as a tombstone with
``purged_at`` set) and its whole history. A purged run is never claimed or requeued, and
:func:`outbox.runs.lifecycle.start_run` with its key returns it (purged) instead of starting again.
Each batch is one short statement over at most *batch_size* rows locked with
``FOR UPDATE SKIP LOCKED``, so retention never waits on, or blocks, live workers for long.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import Engine, cast, delete, func, insert, null, select, update
from sqlalchemy.dialects.postgresql import JSONB, aggregate_order_by

from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import (
    agent_runs,
    run_archive,
    run_effects,
    run_events,
    run_signals,
    step_results,
)
from outbox.db.tables import run_log as log
from outbox.errors import ConfigurationError
from outbox.runs.states import FINISHED, RunState
from outbox.settings import OutboxSettings

DEFAULT_STATES = frozenset(FINISHED)


def purge_batch_plan(older_than: timedelta, batch_size: int, archive: bool,
                     states: Collection[RunState | str]) -> Plan[int]:
    if batch_size <= 0 or older_than < timedelta(0):
        raise ConfigurationError("batch_size must be > 0 and older_than >= 0")
    wanted = sorted(RunState(s).value for s in states)
    if not set(wanted) <= {s.value for s in FINISHED}:
        raise ConfigurationError(f"only finished runs ({sorted(FINISHED)}) can be purged")
    r, s = agent_runs, step_results
    victims = (
        select(r.c.id, r.c.checkpoint)
        .where(r.c.state.in_(wanted), r.c.purged_at.is_(None),
               r.c.finished_at < func.now() - older_than)
        .order_by(r.c.finished_at)
        .limit(batch_size)
        .with_for_update(skip_locked=True)
        .cte("victims")
    )
    dropped = delete(s).where(s.c.run_id.in_(select(victims.c.id))).cte("dropped")
    unlogged = delete(log).where(log.c.run_id.in_(select(victims.c.id))).cte("unlogged")
    # Signals carry the sender's payload: they go with the checkpoint.
    unsignalled = (delete(run_signals).where(run_signals.c.run_id.in_(select(victims.c.id)))
                   .cte("unsignalled"))
    # So do the compensations a finished run declared (their payloads are the caller's).
    forgotten = (delete(run_effects).where(run_effects.c.run_id.in_(select(victims.c.id)))
                 .cte("forgotten"))
    # Its events go with the log they point at (the run's head stays: numbers never restart).
    unnumbered = (delete(run_events).where(run_events.c.run_id.in_(select(victims.c.id)))
                  .cte("unnumbered"))
    purged = (
        update(r).where(r.c.id == victims.c.id)
        .values(checkpoint=cast(null(), JSONB), purged_at=func.now(), updated_at=func.now())
        .returning(r.c.id)
        .cte("purged")
    )
    stmt = (select(func.count()).select_from(purged).add_cte(dropped).add_cte(unlogged)
            .add_cte(unsignalled).add_cte(forgotten).add_cte(unnumbered))
    if archive:
        steps = (
            select(func.jsonb_object_agg(s.c.step_key, s.c.result))
            .where(s.c.run_id == victims.c.id)
            .scalar_subquery()
        )
        entries = (
            select(func.jsonb_agg(aggregate_order_by(log.c.entry, log.c.seq)))
            .where(log.c.run_id == victims.c.id)
            .scalar_subquery()
        )
        archived = insert(run_archive).from_select(
            ["run_id", "checkpoint", "step_results", "log"],
            select(victims.c.id, victims.c.checkpoint, steps, entries),
        )
        stmt = stmt.add_cte(archived.cte("archived"))
    rows = yield stmt
    count: int = rows[0]["count"] if rows else 0
    return count


def purge_batch(conn: SyncConn, *, older_than: timedelta, batch_size: int = 100,
                archive: bool = False, states: Collection[RunState | str] = DEFAULT_STATES,
                settings: OutboxSettings | None = None) -> int:
    """Purge one batch in the caller's transaction (never commits); returns how many runs."""
    return run_plan(conn, purge_batch_plan(older_than, batch_size, archive, states), settings)


def purgeable_plan(older_than: timedelta, states: Collection[RunState | str]) -> Plan[int]:
    wanted = sorted(RunState(s).value for s in states)
    r = agent_runs
    rows = yield select(func.count()).select_from(r).where(
        r.c.state.in_(wanted), r.c.purged_at.is_(None),
        r.c.finished_at < func.now() - older_than)
    count: int = rows[0]["count"] if rows else 0
    return count


def purgeable(conn: SyncConn, *, older_than: timedelta,
              states: Collection[RunState | str] = DEFAULT_STATES,
              settings: OutboxSettings | None = None) -> int:
    """How many runs :func:`purge` would purge now (a dry run); reads only."""
    return run_plan(conn, purgeable_plan(older_than, states), settings)


@dataclass
class Progress:
    """The purge loop's count and stop rule, shared by :func:`purge` and its asyncio twin."""

    batch_size: int
    on_batch: Callable[[int], object] | None
    total: int = 0

    def more_after(self, done: int) -> bool:
        """Count a committed batch of *done* runs; False after a short batch (nothing left)."""
        self.total += done
        if self.on_batch is not None:
            self.on_batch(done)
        return done >= self.batch_size


def purge(engine: Engine, *, older_than: timedelta, batch_size: int = 100,
          max_batches: int = 1000, archive: bool = False,
          states: Collection[RunState | str] = DEFAULT_STATES,
          settings: OutboxSettings | None = None,
          on_batch: Callable[[int], object] | None = None) -> int:
    """Purge finished runs older than *older_than*, each batch in its own short transaction.

    Commits (one transaction per batch): this is a maintenance job, not part of a caller's
    unit of work. Stops after a short batch or *max_batches*; returns the runs purged.
    *on_batch* is called with each committed batch's count (e.g. to show progress).
    """
    progress = Progress(batch_size, on_batch)
    for _ in range(max_batches):
        with engine.begin() as conn:
            done = purge_batch(conn, older_than=older_than, batch_size=batch_size,
                               archive=archive, states=states, settings=settings)
        if not progress.more_after(done):
            break
    return progress.total
