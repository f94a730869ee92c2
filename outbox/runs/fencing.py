"""The one fenced write every run change goes through, and the explanation when it misses.

A fenced write is a single SQL statement::

    WITH old   AS (SELECT id, state FROM agent_runs WHERE id = :run FOR UPDATE),
         moved AS (UPDATE agent_runs SET ..., version = version + 1 FROM old
                   WHERE <lease token and version match> AND state IN (<allowed sources>)
                   RETURNING agent_runs.*, old.state AS from_state),
         hist  AS (INSERT INTO run_transitions ... SELECT ... FROM moved),
         [also AS (INSERT ... SELECT ... FROM moved)]
    SELECT * FROM moved

so a stale lease or an illegal move updates nothing *and* records no history. When it
returns no row, :func:`write` reads the run once to say why (RunNotFound, LeaseLost,
IllegalTransition, WorkflowRetired) and raises.

The two writes on a worker's per-step path carry the same fence as named queries sent to the
driver (``outbox/db/queries.sql``: ``save_checkpoint``, :mod:`outbox.runs.runlog`; and
``transition``, :mod:`outbox.runs.moves`); a miss of theirs is explained by :func:`explain`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    Insert,
    RowMapping,
    Select,
    cast,
    exists,
    func,
    insert,
    literal,
    null,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB

from outbox.db.execution import Plan
from outbox.db.tables import agent_runs, run_transitions, workflows
from outbox.errors import IllegalTransition, LeaseLost, RunNotFound, WorkflowRetired
from outbox.runs import wakeups
from outbox.runs.checkpoints import KEEP, checkpoint_value, json_value
from outbox.runs.leases import Lease
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings

runs = agent_runs

@dataclass(frozen=True)
class HistoryRow:
    """One ``run_transitions`` row written with the change. ``None`` fields take the run's
    value (``from_state``: its state before the write; ``step``: its step after it)."""

    to_state: str
    from_state: str | None = None
    reason: str | None = None
    evidence: Any = None
    step: str | None = None
    actor: str | None = None
    old_step: bool = False
    """With no *step*: the run's step before the write (where a move out of it happened)."""

def retired_clause() -> ColumnElement[bool]:
    """True when the run's workflow is registered as retired."""
    return exists(
        select(workflows.c.name).where(
            workflows.c.name == runs.c.workflow, workflows.c.retired_at.is_not(None)
        )
    )

def lease_values(*, clear: bool) -> dict[str, Any]:
    """Column values that end a lease (the token stays: it only ever grows)."""
    return {"lease_owner": None, "lease_expires_at": None} if clear else {}

def _history_select(moved: CTE, rows: Sequence[HistoryRow]) -> Select[Any]:
    selects = []
    for ordinal, row in enumerate(rows):
        evidence = cast(null(), JSONB) if row.evidence is None else json_value(row.evidence)
        selects.append(
            select(
                moved.c.id.label("run_id"),
                (moved.c.from_state if row.from_state is None else literal(row.from_state))
                .label("from_state"),
                literal(row.to_state).label("to_state"),
                (literal(row.step) if row.step is not None else
                 moved.c.from_step if row.old_step else moved.c.step).label("step"),
                literal(row.reason).label("reason"),
                evidence.label("evidence"),
                literal(row.actor).label("actor"),
                moved.c.lease_token.label("lease_token"),
                literal(ordinal).label("ordinal"),
            )
        )
    united = (union_all(*selects) if len(selects) > 1 else selects[0]).subquery("history")
    columns = [c for c in united.c if c.name != "ordinal"]
    return select(*columns).order_by(united.c.ordinal)

def history_insert(moved: CTE, rows: Sequence[HistoryRow]) -> Insert:
    """``INSERT INTO run_transitions`` one row per *rows* for each row of *moved*."""
    cols = ["run_id", "from_state", "to_state", "step", "reason", "evidence", "actor",
            "lease_token"]
    return insert(run_transitions).from_select(cols, _history_select(moved, rows))

def statement(
    run_id: uuid.UUID,
    *,
    lease: Lease | None,
    sources: Iterable[str],
    values: Mapping[str, Any],
    history: Sequence[HistoryRow] = (),
    where: Sequence[ColumnElement[bool]] = (),
    also: Callable[[CTE], Insert] | None = None,
    woken: Callable[[CTE], ColumnElement[Any]] | None = None,
) -> Select[Any]:
    """The fenced write: update the run and append *history* in one statement, or neither.

    *woken*: a select-list item built on the updated row (:func:`outbox.runs.wakeups.woken`)
    that wakes idle workers at commit, in the same statement.
    """
    old = (select(runs.c.id, runs.c.state, runs.c.step).where(runs.c.id == run_id)
           .with_for_update().cte("old"))
    conditions: list[ColumnElement[bool]] = [
        runs.c.id == old.c.id,
        runs.c.state.in_(sorted(str(s) for s in sources)),
        runs.c.purged_at.is_(None),
        *where,
    ]
    if lease is not None:
        conditions += [runs.c.lease_token == lease.token, runs.c.version == lease.version]
    moved = (
        update(runs)
        .where(*conditions)
        .values({"version": runs.c.version + 1, "updated_at": func.now(),
                 **_waits_end(values), **values})
        .returning(*runs.c, old.c.state.label("from_state"), old.c.step.label("from_step"))
        .cte("moved")
    )
    result = select(moved) if woken is None else select(moved, woken(moved))
    if history:
        result = result.add_cte(history_insert(moved, history).cte("hist"))
    if also is not None:
        result = result.add_cte(also(moved).cte("also"))
    return result

def _waits_end(values: Mapping[str, Any]) -> dict[str, Any]:
    """A change of state ends what a waiting run waited for (signals, children): only the
    write that sets them (a wait) keeps them. The claim clears them as well."""
    if "state" not in values:
        return {}
    return {"awaits_signals": None, "awaits_children": None, "awaits_failure": None,
            "on_child_failure": None, "failed_child": None}


def probe(run_id: uuid.UUID) -> Select[Any]:
    """Read what explains a missed write: the row, its workflow's retirement and the DB clock."""
    reason = (
        select(workflows.c.retired_reason)
        .where(workflows.c.name == runs.c.workflow, workflows.c.retired_at.is_not(None))
        .scalar_subquery()
    )
    return select(
        *runs.c, retired_clause().label("retired"), reason.label("retired_reason"),
        func.now().label("db_now"),
    ).where(runs.c.id == run_id)

def explain(
    run_id: uuid.UUID, lease: Lease | None, to_state: str, sources: Collection[str]
) -> Plan[RowMapping]:
    """Raise the error that explains why a fenced write updated nothing.

    Returns the run's row when none of the generic causes applies, so the caller can name
    its own (e.g. a step already recorded).
    """
    rows = yield probe(run_id)
    if not rows:
        raise RunNotFound(run_id)
    row = rows[0]
    if lease is not None and (row["lease_token"], row["version"]) != (lease.token, lease.version):
        raise LeaseLost(run_id, lease.token)
    if row["state"] not in sources:
        raise IllegalTransition(run_id, row["state"], to_state)
    if row["purged_at"] is not None:
        raise IllegalTransition(run_id, row["state"], to_state,
                                "its checkpoint was purged by retention; start a new run")
    if to_state == RunState.QUEUED and row["retired"]:
        raise WorkflowRetired(row["workflow"], row["retired_reason"])
    return row

def hold(lease: Lease) -> Plan[None]:
    """Check that *lease* holds, reading it under a share lock (as emit's fence does): a claim
    taking the run over waits for this transaction, or this one sees it and raises what
    :func:`explain` says."""
    held = yield (select(runs.c.id).where(
        runs.c.id == lease.run_id, runs.c.lease_token == lease.token,
        runs.c.version == lease.version, runs.c.state == RunState.RUNNING.value,
        runs.c.purged_at.is_(None)).with_for_update(read=True))
    if not held:
        yield from explain(lease.run_id, lease, RunState.RUNNING.value, {RunState.RUNNING.value})
        raise AssertionError("explain raises for a lease that does not hold")  # not reached


def wait_plan(lease: Lease, *, ready: bool, until: Any, waits: Mapping[str, Any], note: str,
              step: str | None, checkpoint: Any, actor: str | None,
              settings: OutboxSettings | None, evidence: Any = None) -> Plan[Lease]:
    """The move of a leased run to ``waiting`` for something (*waits*: the columns saying
    what), ending the lease: claimable at once when it is *ready* already (and an idle
    worker woken), else at *until* (a SQL value, ``None``: only what it waits for wakes it).
    *checkpoint* (``KEEP``: unchanged) is saved with the move."""
    sources = {RunState.RUNNING.value}
    values = {"state": RunState.WAITING.value, "reason": note, **lease_values(clear=True),
              "not_before": func.now() if ready else until, **waits,
              **({"step": step} if step is not None else {}),
              **({} if checkpoint is KEEP else
                 {"checkpoint": checkpoint_value(checkpoint, settings)})}
    stmt = statement(lease.run_id, lease=lease, sources=sources, values=values,
                     history=[HistoryRow(RunState.WAITING, reason=note, actor=actor,
                                         evidence=evidence)],
                     woken=wakeups.woken(settings) if ready else None)
    row = yield from write(stmt, lease.run_id, lease, RunState.WAITING.value, sources)
    assert row is not None
    return next_lease(lease, row)


def write(
    stmt: Select[Any],
    run_id: uuid.UUID,
    lease: Lease | None,
    to_state: str,
    sources: Collection[str],
) -> Plan[RowMapping | None]:
    """Run a fenced *stmt*; on a miss, raise what explains it or return ``None``."""
    rows = yield stmt
    if rows:
        return rows[0]
    yield from explain(run_id, lease, to_state, sources)
    return None

def next_lease(lease: Lease, row: RowMapping) -> Lease:
    """The lease after a successful fenced write (same token, the row's new version)."""
    return Lease(
        run_id=lease.run_id,
        owner=lease.owner,
        token=lease.token,
        version=row["version"],
        expires_at=row["lease_expires_at"] or lease.expires_at,
    )
