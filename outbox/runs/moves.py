"""The fenced move of a leased run (:func:`outbox.runs.lifecycle.transition`) as one named query.

Every run a worker steps ends with a move (to ``done``, ``waiting``...), so the move is on the
worker's hot path, like the checkpoint save (:func:`outbox.runs.runlog.save_statement`). Built
with SQLAlchemy Core through :func:`outbox.runs.fencing.statement`, it cost ~1.7 ms of client
CPU per move: building the statement, SQLAlchemy's cache key and compile of it, and a text over
psycopg's 4096-character parse cache. The named query ``transition`` (``outbox/db/queries.sql``)
is the same fenced write (this run, its lease token and version, running, not purged; the
history row in the same statement) sent to psycopg as is. Everything a caller can get wrong is
checked here, before anything is sent; a missed fence is explained by
:func:`outbox.runs.fencing.explain`, as for every fenced write.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from outbox.db.execution import DriverStatement
from outbox.db.queries import driver_sql
from outbox.errors import EvidenceRequired, IllegalTransition
from outbox.runs import runlog
from outbox.runs.checkpoints import Keep, checked_json, encoded
from outbox.runs.leases import Lease
from outbox.runs.states import ALLOWED, FINISHED, RunState
from outbox.settings import OutboxSettings, default_settings


def statement(
    lease: Lease, to: RunState | str, *, step: str | None, reason: str | None, evidence: Any,
    actor: str | None, checkpoint: Any, wake_at: datetime | timedelta | None,
    settings: OutboxSettings | None, log: runlog.Log | None = None,
) -> DriverStatement:
    """The move of the leased run to *to* as the named query ``transition`` and its parameters.

    Raises :class:`IllegalTransition` (a move :data:`~outbox.runs.states.ALLOWED` does not
    have from ``running``), :class:`EvidenceRequired` (``done`` without *evidence*) and
    :class:`~outbox.errors.CheckpointTooLarge`, in that order, before anything is sent.
    """
    target = RunState(to)
    if target not in ALLOWED[RunState.RUNNING]:
        raise IllegalTransition(lease.run_id, RunState.RUNNING.value, target.value,
                                "a lease is only held while the run is running")
    if target is RunState.DONE and evidence is None:
        raise EvidenceRequired(lease.run_id, target.value)
    keep = isinstance(checkpoint, Keep)
    stored = None if keep else checked_json(checkpoint, settings)
    waiting = target is RunState.WAITING
    seqs, entries = runlog.encoded(log, settings)
    params = {
        "run_id": lease.run_id, "token": lease.token, "version": lease.version,
        "to_state": target.value, "step": step, "reason": reason,
        "evidence": None if evidence is None else encoded(evidence),
        "actor": actor or lease.owner, "keep_checkpoint": keep, "checkpoint": stored,
        "finished": target in FINISHED,
        # waiting: claimable again at wake_at (a time, or a delay from the database's clock);
        # without one, only wake() makes it claimable. Other states leave not_before alone.
        "waiting": waiting,
        "wake_at": wake_at if waiting and isinstance(wake_at, datetime) else None,
        "wake_after": wake_at if waiting and isinstance(wake_at, timedelta) else None,
        "log_seqs": seqs, "log_entries": entries,
    }
    schema = (settings or default_settings()).schema_name
    return DriverStatement(driver_sql("outbox.db", "transition", schema), params)


def moved_lease(lease: Lease, row: Any) -> Lease | None:
    """The lease after a move that returned *row* (it only proves the move: the run left
    ``running``); ``None`` when the fence missed."""
    if row["version"] is None:
        return None
    return Lease(run_id=lease.run_id, owner=lease.owner, token=lease.token,
                 version=row["version"], expires_at=lease.expires_at)
