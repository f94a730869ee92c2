"""Retention of the operations ledger: settled operations and their events, in small batches.

An operation's row is what stops a redelivered message from calling the outside system a
second time: the redelivery derives the same idempotency key, finds the row and returns its
outcome. Once the row is gone, the same message would place the order again. So a settled
operation may go only when its message can no longer come back, which is what the consumers'
dedup window promises (``dedup_retention_seconds``, at least the topic's retention plus the
worst lag: :mod:`dedup.window`). Hence the rule, checked by every entry point here:

    older_than_seconds >= the dedup window of every consumer group that calls ``perform``

What is deleted: ``confirmed`` / ``rejected`` operations (a human's confirmation included)
settled more than *older_than_seconds* ago, with their ``operation_events``. What stays:

* open ones (``pending``, ``unknown``, ``not-applied``) and ``needs-human``: their outcome is
  not established, so the row is all we know;
* any whose message still waits in ``consumer_failures`` (``retrying``, ``dead-lettered``,
  or ``replayed`` within the window): a replay can come any time and must find its row.

Each batch is one short transaction: lock up to *batch* rows by primary key with ``FOR
UPDATE SKIP LOCKED`` (a row someone is touching is left for the next pass), delete their
events, delete them. Nothing waits on live consumers, and nothing holds locks for long.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, delete, exists, func, or_, select

from dedup.ledger.operations import SETTLED, events, ops
from dedup.window import human_duration
from outbox.db.execution import Plan, SyncConn, run_plan
from outbox.db.tables import consumer_failures
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

DAY = 86_400.0
DEFAULT_OLDER_THAN_SECONDS = 30 * DAY
"""Like ``outbox purge``: well past the default dedup window, short enough to keep tables lean."""
DEFAULT_DEDUP_WINDOW_SECONDS = 8 * DAY
"""The consumers' default ``dedup_retention_seconds`` (consumers/settings.py; dedup may not
import consumers, a test keeps the two equal). Pass your own if you changed it."""
DEFAULT_BATCH = 100
PURGED_STATUSES = tuple(sorted(s.value for s in SETTLED))
_PARKED = ("retrying", "dead-lettered")


@dataclass(frozen=True)
class OperationsPurge:
    """How many operations (and events with them) a purge deleted, or a dry run would."""

    operations: int
    events: int


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s ({human_duration(seconds)})"


def check_retention_window(older_than_seconds: float,
                           dedup_window_seconds: float | None) -> None:
    """Raise :class:`ConfigurationError` unless *older_than_seconds* outlives the dedup window.

    *dedup_window_seconds* is the consumers' ``dedup_retention_seconds``
    (``OUTBOXKIT_CONSUMER_DEDUP_RETENTION_SECONDS``); ``0`` there means marks are kept
    forever, so no operations window is known to be safe and one must be given explicitly.
    ``None`` skips the check (the caller vouches for the window).
    """
    if older_than_seconds <= 0:
        raise ConfigurationError(
            f"older_than_seconds (the operations retention window) must be > 0, "
            f"got {older_than_seconds}")
    if dedup_window_seconds is None:
        return
    if dedup_window_seconds < 0:
        raise ConfigurationError(
            f"dedup_window_seconds must be >= 0, got {dedup_window_seconds}")
    if dedup_window_seconds == 0:
        raise ConfigurationError(
            "the consumers keep dedup marks forever (dedup_retention_seconds / "
            "OUTBOXKIT_CONSUMER_DEDUP_RETENTION_SECONDS = 0), so no operations window is known "
            "to be safe: give dedup_window_seconds (--dedup-window) as the longest a message "
            "may still be redelivered")
    if older_than_seconds < dedup_window_seconds:
        raise ConfigurationError(
            f"older_than_seconds (the operations retention window, --older-than) of "
            f"{_span(older_than_seconds)} is shorter than the consumers' dedup window "
            f"(dedup_retention_seconds / OUTBOXKIT_CONSUMER_DEDUP_RETENTION_SECONDS = "
            f"{_span(dedup_window_seconds)}): a message redelivered after its operation is "
            f"purged would call the outside system again; set it to at least "
            f"{_span(dedup_window_seconds)}")


def _purgeable(older_than_seconds: float) -> Any:
    """The WHERE clause of a purgeable operation (see the module docstring)."""
    cutoff = func.now() - timedelta(seconds=older_than_seconds)
    f = consumer_failures
    waiting = exists().where(
        f.c.message_id == ops.c.message_id,
        or_(f.c.status.in_(_PARKED), (f.c.status == "replayed") & (f.c.replayed_at >= cutoff)),
    )
    return (
        ops.c.status.in_(PURGED_STATUSES)
        # Redundant (settling comes after creation) but lets operations_status_idx
        # (status, created_at) find the old rows without reading the whole settled table.
        & (ops.c.created_at < cutoff)
        & (func.coalesce(ops.c.resolved_at, ops.c.updated_at) < cutoff)
        & ~waiting
    )


def purge_batch_plan(older_than_seconds: float, batch: int) -> Plan[OperationsPurge]:
    if batch <= 0:
        raise ConfigurationError(f"batch must be > 0, got {batch}")
    # No ORDER BY: any old rows will do, and sorting every candidate would cost a full scan
    # of the backlog on each batch.
    rows = yield (
        select(ops.c.id).where(_purgeable(older_than_seconds)).limit(batch)
        .with_for_update(of=ops, skip_locked=True)
    )
    ids: list[uuid.UUID] = [row["id"] for row in rows]
    if not ids:
        return OperationsPurge(0, 0)
    # Events first: they reference the operation. Our row lock keeps new ones out meanwhile
    # (an insert needs a key-share lock on the operation).
    gone_events = yield delete(events).where(events.c.operation_id.in_(ids)).returning(events.c.id)
    gone = yield delete(ops).where(ops.c.id.in_(ids)).returning(ops.c.id)
    return OperationsPurge(len(gone), len(gone_events))


def purge_operations_batch(conn: SyncConn, older_than_seconds: float, *,
                           batch: int = DEFAULT_BATCH,
                           settings: OutboxSettings | None = None) -> OperationsPurge:
    """Delete one batch in the caller's transaction (never commits; commit promptly).

    Checks no window: :func:`purge_operations` does, before its first batch.
    """
    return run_plan(conn, purge_batch_plan(older_than_seconds, batch), settings)


def count_plan(older_than_seconds: float) -> Plan[OperationsPurge]:
    doomed = select(ops.c.id).where(_purgeable(older_than_seconds)).subquery()
    rows = yield select(
        select(func.count()).select_from(doomed).scalar_subquery().label("operations"),
        select(func.count()).select_from(events)
        .where(events.c.operation_id.in_(select(doomed.c.id))).scalar_subquery().label("events"),
    )
    return OperationsPurge(rows[0]["operations"], rows[0]["events"])


def count_purgeable_operations(
    conn: SyncConn, older_than_seconds: float, *,
    dedup_window_seconds: float | None = DEFAULT_DEDUP_WINDOW_SECONDS,
    settings: OutboxSettings | None = None,
) -> OperationsPurge:
    """What :func:`purge_operations` would delete now (a dry run); reads only.

    Refuses the same windows as the purge itself (:func:`check_retention_window`).
    """
    check_retention_window(older_than_seconds, dedup_window_seconds)
    return run_plan(conn, count_plan(older_than_seconds), settings)


def purge_operations(
    engine: Engine,
    older_than_seconds: float,
    *,
    batch: int = DEFAULT_BATCH,
    dedup_window_seconds: float | None = DEFAULT_DEDUP_WINDOW_SECONDS,
    max_batches: int = 1000,
    dry_run: bool = False,
    settings: OutboxSettings | None = None,
    on_batch: Callable[[OperationsPurge], object] | None = None,
) -> int:
    """Delete settled operations (and their events) settled over *older_than_seconds* ago.

    Commits one short transaction per *batch* operations; stops after a short batch or
    *max_batches*. Returns how many operations went (with ``dry_run``: would go, deleting
    nothing). *on_batch* gets each committed batch's counts (e.g. to show progress).

    *dedup_window_seconds* is the longest dedup window (``dedup_retention_seconds``) of the
    consumer groups that call ``perform``; a shorter *older_than_seconds* is refused with a
    :class:`ConfigurationError` before anything is deleted. ``None`` skips that check.
    """
    check_retention_window(older_than_seconds, dedup_window_seconds)
    if dry_run:
        with engine.connect() as conn:
            return count_purgeable_operations(conn, older_than_seconds, dedup_window_seconds=None,
                                              settings=settings).operations
    total = 0
    for _ in range(max_batches):
        with engine.begin() as conn:
            done = purge_operations_batch(conn, older_than_seconds, batch=batch,
                                          settings=settings)
        total += done.operations
        if on_batch is not None:
            on_batch(done)
        if done.operations < batch:
            break
    return total
