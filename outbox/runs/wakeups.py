"""Waking idle workers at commit: a NOTIFY when a run becomes claimable, while one waits.

Starting a run, waking a waiting one, an operator's requeue, a confirmation that moves a
run on and a retry's requeue each add ``pg_notify(<channel>, <workflow>)`` to the select
list of the statement that makes the change: no extra round trip, and PostgreSQL delivers it
only when the transaction commits (never for one rolled back). The channel is derived from
the schema name, so workers of another schema in the same database are not woken. A worker
(:mod:`outbox.worker`) LISTENs on it and claims at once instead of polling.

Like emit's wake-up of the relay (:mod:`outbox.messages.emit`), it fires only while some
worker has declared itself idle (``run_workers.idle_until`` in the future): a transaction
that NOTIFYs takes a database-wide lock at commit, so commits pay it only when a worker waits
for them, never while every worker is busy or none runs. A worker declares itself idle when a
claim found nothing, then claims once more. The statement asks through ``wake_workers``
(migration 0016), which takes a shared advisory lock before it reads the declarations; the
worker claims once more only after it could take that lock exclusively (:func:`settled`), so a
transaction that read the declarations before they said "idle" has ended by then and that
claim finds its run: none waits for the fallback poll. That holds for READ COMMITTED, the
default: a REPEATABLE READ or SERIALIZABLE transaction reads the declarations as of its start,
so one that began before a worker declared itself idle may still leave its run to the
fallback poll. ``notify=False`` leaves
the NOTIFY out altogether: for a transaction that will be prepared (``PREPARE TRANSACTION`` is
refused after a NOTIFY); a worker then finds the run by its due-time wake-up or fallback poll.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    CTE,
    Boolean,
    ColumnElement,
    Select,
    delete,
    func,
    literal,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import Delete, Insert
from sqlalchemy.sql.functions import Function

from outbox.db.queries import runs_channel
from outbox.db.tables import run_workers
from outbox.settings import OutboxSettings, default_settings


def channel(settings: OutboxSettings | None) -> str:
    """The LISTEN/NOTIFY channel of the runs in *settings*' schema (``<schema>_runs``)."""
    return runs_channel((settings or default_settings()).schema_name)


# The advisory lock's class (two-int form: never one of emit's bigint keys); its second half
# is hashtext(<channel>), so each schema's workers have their own. Migration 0016 writes it.
WAKE_LOCK_CLASS = 0x6F6B7772  # "okwr"


def notify(workflow: ColumnElement[str], settings: OutboxSettings | None) -> ColumnElement[Any]:
    """A select-list item that NOTIFYs the runs channel with *workflow* (fires at commit), if
    a worker waits (``wake_workers``, migration 0016: true when it notified)."""
    schema = (settings or default_settings()).schema_name
    return Function("wake_workers", workflow, packagenames=(schema,),
                    type_=Boolean).label("notified")


def settled(settings: OutboxSettings | None) -> Select[tuple[bool]]:
    """True once no transaction that may have read the declarations before this worker's
    is still open (the exclusive form of ``wake_workers``' lock, never queued: false means
    look again shortly). Run it in autocommit: the lock is then dropped with the statement
    (held until a COMMIT, it would make every wake-up of the schema wait for that)."""
    key = func.hashtext(literal(channel(settings)))
    return select(func.pg_try_advisory_xact_lock(literal_column(str(WAKE_LOCK_CLASS)), key))


def woken(settings: OutboxSettings | None) -> Callable[[CTE], ColumnElement[Any]]:
    """:func:`notify` for a fenced write (:func:`outbox.runs.fencing.statement`'s ``woken``)."""
    return lambda moved: notify(moved.c.workflow, settings)


def declare_idle(worker: str, seconds: float) -> Insert:
    """*worker* waits for runs for the next *seconds* (it renews this while it idles)."""
    until = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, literal(seconds))
    stmt = pg_insert(run_workers).values(worker=worker, idle_until=until)
    return stmt.on_conflict_do_update(index_elements=[run_workers.c.worker],
                                      set_={"idle_until": stmt.excluded.idle_until})


def declare_busy(worker: str) -> Delete:
    """*worker* waits for nothing (every slot busy, or stopping): commits stop notifying it."""
    return delete(run_workers).where(run_workers.c.worker == worker)


def forget_dead() -> Delete:
    """The declarations of workers gone for an hour (killed before withdrawing theirs)."""
    an_hour_ago = func.now() - func.make_interval(0, 0, 0, 0, 1)
    return delete(run_workers).where(run_workers.c.idle_until < an_hour_ago)
