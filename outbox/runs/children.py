"""Child runs and their join: a step fans out, waits, and wakes with its children's results.

* ``app.start_run(conn, child, idempotency_key=key, checkpoint=..., parent=job)`` starts a
  child in the parent step's transaction: its key is the parent's id and *key*, so a step
  that runs again (after a crash) starts each child once; the same key with another
  checkpoint is refused. Children are ordinary runs of any registered workflow.
* ``job.wait_for_children(join="all" | "first" | n, until=...)`` moves the parent to
  ``waiting`` until that many of its children are finished (``done`` or ``failed``), or
  makes it claimable at once when they already are.
* A child's move to a finished state wakes the parent in the child's transaction, through a
  trigger (migration 0013), whatever made the move. Children finishing at once take turns on
  the parent's row, so the last one counts the others; the wait locks that row too before it
  counts, so no child's finish falls between the count and the wait.
* The woken parent reads ``job.children()`` (state, checkpoint, evidence of each) and
  decides: a failed child is the parent's to handle (retry it as a new child, fail, compensate).
* ``app.start_children(job, child, {key: checkpoint, ...}, concurrency=n)`` starts many in
  one statement (:func:`start_many_plan`); beyond *n* unfinished children they are held
  (queued, ``not_before`` from :data:`~outbox.runs.lifecycle.HELD_AT`), and a child that
  finishes releases held ones while fewer than *n* run (the trigger of migration 0015).
* :func:`cancel_plan` (``app.cancel``) fails a run and every unfinished run below it; each
  with effects to undo compensates first (:mod:`outbox.runs.compensation`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    TIMESTAMP,
    Integer,
    Text,
    column,
    exists,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.db.execution import Plan
from outbox.db.tables import agent_runs, workflows
from outbox.errors import ConfigurationError, IllegalTransition, RunNotFound, WorkflowRetired
from outbox.runs import compensation, fencing, wakeups
from outbox.runs.checkpoints import KEEP, bounded
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import HELD_AT, Run, move_plan, transition_plan, wake_value
from outbox.runs.states import FINISHED, RunState
from outbox.settings import OutboxSettings

Join = Literal["all", "first"] | int
OnFailure = Literal["fail", "compensate"]
ON_FAILURE: tuple[OnFailure, ...] = ("fail", "compensate")
_FINISHED = sorted(s.value for s in FINISHED)


def child_key(parent: uuid.UUID, key: str) -> str:
    """A child's idempotency key: unique per parent, so two parents may use the same *key*."""
    if not isinstance(key, str) or not key:
        raise ConfigurationError("a child's idempotency_key must be a non-empty string")
    return f"{parent}/{key}"


def children_plan(run_id: uuid.UUID) -> Plan[list[Run]]:
    # Children started in one transaction share created_at: then in the order of their keys.
    rows = yield (select(agent_runs).where(agent_runs.c.parent_id == run_id)
                  .order_by(agent_runs.c.created_at, agent_runs.c.idempotency_key))
    return [Run.from_row(row) for row in rows]


def wait_plan(lease: Lease, join: Join, *, until: datetime | timedelta | None,
              step: str | None, reason: str | None, actor: str | None,
              settings: OutboxSettings | None, checkpoint: Any = KEEP,
              fail_fast: bool = False, on_failure: OnFailure | None = None) -> Plan[Lease]:
    """Move the run to ``waiting`` for *join* of the children it started since its previous
    join, or (*fail_fast*, or *on_failure*) the first of them that fails (claimable at once
    when that is so already); ends the lease. *on_failure* is kept for the worker
    (:func:`failure_plan`)."""
    if on_failure not in (None, *ON_FAILURE):
        raise ConfigurationError(f"on_failure must be one of {list(ON_FAILURE)} or None, "
                                 f"got {on_failure!r}")
    fail_fast = fail_fast or on_failure is not None
    r = agent_runs
    # The row lock first (see the module's doc), then a fresh statement counts.
    rows = yield (select(r.c.children_since).where(r.c.id == lease.run_id)
                  .with_for_update(key_share=True))
    since = rows[0]["children_since"] if rows else None
    wave = [r.c.parent_id == lease.run_id]
    if since is not None:
        wave.append(r.c.created_at > since)
    rows = yield select(func.count().label("total"),
                        func.count().filter(r.c.state.in_(_FINISHED)).label("finished"),
                        func.count().filter(r.c.state == RunState.FAILED.value).label("failed"),
                        ).where(*wave)
    total, finished = rows[0]["total"], rows[0]["finished"]
    needed = _needed(join, total, lease.run_id)
    ready = finished >= needed or (fail_fast and rows[0]["failed"] > 0)
    note = reason or f"waits for {join if isinstance(join, str) else needed} of its " \
                     f"{total} children" + (" (or the first to fail)" if fail_fast else "")
    waits: dict[str, Any] = {"awaits_children": None if ready else needed,
                             "awaits_failure": True if fail_fast and not ready else None,
                             "on_child_failure": on_failure}
    if on_failure is not None and rows[0]["failed"] > 0:
        # a child of this wave failed already: name it for the policy, as the trigger would
        failed = yield (select(r.c.id).where(*wave, r.c.state == RunState.FAILED.value)
                        .order_by(r.c.finished_at).limit(1))
        waits["failed_child"] = failed[0]["id"]
    if ready:  # this join is met: the next counts the children started after it
        waits["children_since"] = func.now()
    return (yield from fencing.wait_plan(
        lease, ready=ready, until=wake_value(until, aware=True), waits=waits, note=note,
        step=step, checkpoint=checkpoint, actor=actor, settings=settings))


def start_plan(lease: Lease, start: Plan[Run]) -> Plan[Run]:
    """*start* (a child's :func:`~outbox.runs.lifecycle.start_run_plan`) only while *lease*
    holds, read under a share lock (as emit's fence): a step whose run was taken over starts
    nothing."""
    yield from fencing.hold(lease)
    return (yield from start)


def _needed(join: Join, total: int, run_id: uuid.UUID) -> int:
    if total == 0:
        raise ConfigurationError(
            f"run {run_id} has no children to wait for: start them first "
            "(app.start_run(..., parent=job)), in this transaction or an earlier one")
    if join == "all":
        return total
    if join == "first":
        return 1
    if isinstance(join, bool) or not isinstance(join, int) or not 1 <= join <= total:
        raise ConfigurationError(
            f"join must be 'all', 'first' or a number of children from 1 to {total}, "
            f"got {join!r}")
    return join


@dataclass(frozen=True)
class Cancelled:
    """What :func:`cancel_plan` did: the runs it failed (or sent compensating), the run first
    then its descendants; those a worker holds under a live lease (left alone: cancel again
    once their step ends); and those compensating already (left to finish their undoing,
    which ends them failed), whose children it cancelled all the same."""

    moved: list[Run]
    held: list[uuid.UUID]
    compensating: list[uuid.UUID]


def cancel_plan(run_id: uuid.UUID, *, actor: str, reason: str,
                settings: OutboxSettings | None, notify: bool = True) -> Plan[Cancelled]:
    """Fail *run_id* and its unfinished descendants, parents before children (a child's
    finish then finds its parent no longer waiting). A finished run, or one a worker holds,
    raises :class:`IllegalTransition` and nothing moves."""
    done = Cancelled([], [], [])
    # A finished run is refused before anything is locked: the tree's locks would make a
    # worker's claim skip its children (SKIP LOCKED) for a cancel that does nothing.
    rows = yield select(agent_runs.c.state).where(agent_runs.c.id == run_id)
    if not rows:
        raise RunNotFound(run_id)
    if rows[0]["state"] in _FINISHED:
        raise IllegalTransition(run_id, rows[0]["state"], RunState.FAILED.value,
                                "it is finished already")
    yield from _lock_tree(run_id)
    yield from _cancel_one(run_id, root=run_id, actor=actor, reason=reason, settings=settings,
                           notify=notify, done=done)
    yield from _cancel_below(run_id, root=run_id, actor=actor, reason=reason,
                             settings=settings, notify=notify, done=done)
    return done


def orphan_plan(run_id: uuid.UUID, *, actor: str,
                settings: OutboxSettings | None) -> Plan[Cancelled | None]:
    """After a child's step ended in a state that is not final: if its parent failed or
    began undoing its effects while the step ran, fail the child (and its own unfinished
    descendants) now. A cancel, or a sibling's failure acted on (``on_failure``), leaves a
    child a worker holds to end its step (:func:`_cancel_one`); this is that end. ``None``:
    its parent goes on (or it has none, or it is finished or held again)."""
    r, parent = agent_runs, agent_runs.alias("parent")
    rows = yield (select(r.c.state, parent.c.id.label("parent"),
                         parent.c.state.label("parent_state"), parent.c.compensating_since)
                  .select_from(r.join(parent, parent.c.id == r.c.parent_id))
                  .where(r.c.id == run_id))
    if not rows or rows[0]["state"] in _FINISHED or rows[0]["state"] == RunState.RUNNING.value:
        return None
    if rows[0]["parent_state"] != RunState.FAILED.value and rows[0]["compensating_since"] is None:
        return None
    return (yield from cancel_plan(
        run_id, actor=actor, settings=settings,
        reason=f"its parent {rows[0]['parent']} failed while this run's step ran"))


def _lock_tree(run_id: uuid.UUID) -> Plan[None]:
    """Lock *run_id* and its unfinished descendants, the deepest first: a child finishing
    meanwhile holds its own row and takes its parent's at its commit (the trigger), so
    locking parents before children would wait for it crosswise (a deadlock)."""
    r = agent_runs
    tree = select(r.c.id, literal(0).label("depth")).where(r.c.id == run_id).cte(
        "tree", recursive=True)
    tree = tree.union_all(
        select(r.c.id, tree.c.depth + 1).where(r.c.parent_id == tree.c.id,
                                               r.c.state.not_in(_FINISHED)))
    yield (select(r.c.id).join(tree, r.c.id == tree.c.id)
           .order_by(tree.c.depth.desc(), r.c.id).with_for_update(of=r))


def _cancel_one(current: uuid.UUID, *, root: uuid.UUID, actor: str, reason: str,
                settings: OutboxSettings | None, notify: bool, done: Cancelled) -> Plan[None]:
    rows = yield select(agent_runs.c.compensating_since, agent_runs.c.state).where(
        agent_runs.c.id == current)
    if rows and rows[0]["compensating_since"] is not None \
            and rows[0]["state"] not in _FINISHED:
        done.compensating.append(current)  # failing already: left to finish its undoing
        return
    if current != root and rows and rows[0]["state"] in _FINISHED:
        return  # finished meanwhile
    try:
        done.moved.append((yield from move_plan(
            current, RunState.FAILED, actor=actor, reason=reason,
            evidence={"cancelled_by": actor, "cancelled": str(root)},
            not_before=None, settings=settings, notify=notify)))
    except IllegalTransition:
        if current == root:
            raise
        done.held.append(current)  # a worker holds it: it ends its step first


def _cancel_below(parent: uuid.UUID, *, root: uuid.UUID, actor: str, reason: str,
                  settings: OutboxSettings | None, notify: bool,
                  done: Cancelled) -> Plan[Cancelled]:
    """Cancel *parent*'s unfinished descendants, each generation after its parents."""
    todo = [parent]
    while todo:
        rows = yield (select(agent_runs.c.id).where(agent_runs.c.parent_id == todo.pop(0),
                                                    agent_runs.c.state.not_in(_FINISHED))
                      .order_by(agent_runs.c.created_at, agent_runs.c.idempotency_key))
        for row in rows:
            yield from _cancel_one(row["id"], root=root, actor=actor, reason=reason,
                                   settings=settings, notify=notify, done=done)
            todo.append(row["id"])
    return done


def start_many_plan(lease: Lease, items: Sequence[tuple[str, Any]], *, pins: Mapping[str, Any],
                    concurrency: int | None, settings: OutboxSettings | None,
                    notify: bool = True) -> Plan[list[Run]]:
    """Start one child of *lease*'s run per (key, checkpoint) of *items*, in one statement;
    return them in the order of *items*. A key started already (the step ran before a
    crash) is that child, if its workflow and checkpoint are the same; else nothing is
    started and a ConfigurationError names the key. *concurrency*: kept as the parent's
    bound, at most that many of its children unfinished and not held at once; the new
    children beyond it start held, and the trigger of migration 0015 releases them."""
    keys = [key for key, _ in items]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ConfigurationError(f"children's keys must be unique: {twice} given twice")
    if concurrency is not None and (isinstance(concurrency, bool)
                                    or not isinstance(concurrency, int) or concurrency < 1):
        raise ConfigurationError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
    for _, checkpoint in items:
        bounded(checkpoint, settings)
    if not items:
        return []
    yield from fencing.hold(lease)
    r = agent_runs
    workflow = pins["workflow"]
    child_keys = [child_key(lease.run_id, key) for key in keys]
    given = _recordset([{"key": k, "checkpoint": c, "ord": n} for n, (k, c) in
                        enumerate(zip(child_keys, (c for _, c in items), strict=True))],
                       held=False)
    # Children started already (the step ran before a crash) first: one of another input
    # refuses the whole batch before anything is written.
    rows = yield (select(r, given.c.ord,
                         r.c.checkpoint.is_not_distinct_from(given.c.checkpoint)
                         .label("same_input"))
                  .select_from(r.join(given, r.c.idempotency_key == given.c.key)))
    for row in rows:
        if row["workflow"] != workflow or not row["same_input"]:
            raise ConfigurationError(
                f"child key {keys[row['ord']]!r} already started run {row['id']} with another "
                f"{'workflow' if row['workflow'] != workflow else 'checkpoint'}: a child's key "
                "names one input (use a new key for new input); nothing was started")
    found = {row["ord"]: Run.from_row(row) for row in rows}
    new = [n for n in range(len(items)) if n not in found]
    if not new:
        return [found[n] for n in range(len(items))]
    counts = yield select(
        func.count().label("total"),
        func.count().filter(r.c.state.not_in(_FINISHED), func.coalesce(
            r.c.not_before, func.now()) < literal(HELD_AT, r.c.not_before.type)).label("live"),
    ).where(r.c.parent_id == lease.run_id)
    free = len(new) if concurrency is None else max(concurrency - counts[0]["live"], 0)
    # Held in the items' order, after any child the parent held before.
    data = [{"key": child_keys[n], "checkpoint": items[n][1], "ord": n,
             "held": None if i < free else (HELD_AT + timedelta(
                 microseconds=counts[0]["total"] + i)).isoformat()}
            for i, n in enumerate(new)]
    fresh = _recordset(data, held=True)
    source = select(
        func.gen_random_uuid(), literal(workflow), literal(pins["workflow_version"]),
        literal(pins["prompt_version"], Text), literal(pins["tool_schema_version"], Text),
        literal(RunState.QUEUED.value), fresh.c.checkpoint, fresh.c.key,
        literal(lease.run_id, r.c.parent_id.type), fresh.c.held,
    ).where(~exists(select(workflows.c.name).where(
        workflows.c.name == workflow, workflows.c.retired_at.is_not(None)))
    ).order_by(fresh.c.ord)
    inserted = (
        pg_insert(r).from_select(["id", "workflow", "workflow_version", "prompt_version",
                                  "tool_schema_version", "state", "checkpoint",
                                  "idempotency_key", "parent_id", "not_before"], source)
        .on_conflict_do_nothing(index_elements=[r.c.idempotency_key])
        .returning(*r.c, literal(None).label("from_state"))
        .cte("inserted"))
    history = fencing.history_insert(
        inserted, [fencing.HistoryRow(RunState.QUEUED, reason="started", actor="start_run")])
    started = (select(inserted, wakeups.notify(inserted.c.workflow, settings)) if notify
               else select(inserted)).add_cte(history.cte("hist"))
    if concurrency is not None:  # the bound the trigger releases by, kept on the parent
        started = started.add_cte(update(r).where(r.c.id == lease.run_id)
                                  .values(children_limit=concurrency).cte("bound"))
    order = {entry["key"]: entry["ord"] for entry in data}
    for row in (yield started):
        found[order[row["idempotency_key"]]] = Run.from_row(row)
    if len(found) < len(items):  # neither there nor inserted: the workflow is retired
        rows = yield select(workflows.c.retired_reason).where(workflows.c.name == workflow)
        raise WorkflowRetired(workflow, rows[0]["retired_reason"] if rows else None)
    return [found[n] for n in range(len(items))]


def _recordset(data: list[dict[str, Any]], *, held: bool) -> Any:
    """*data* (one JSON object per child) as a table in a statement."""
    columns = [column("key", Text), column("checkpoint", JSONB), column("ord", Integer)]
    if held:
        columns.append(column("held", TIMESTAMP(timezone=True)))
    return func.jsonb_to_recordset(literal(data, JSONB)).table_valued(*columns).render_derived(
        name="fresh" if held else "given", with_types=True)


def failure_plan(lease: Lease, run: Run, *, actor: str,
                 settings: OutboxSettings | None) -> Plan[Lease | None]:
    """What the worker does first with a claimed parent whose last join declared
    ``on_failure``: if one of its children failed, cancel its other unfinished children and
    fail the parent (``"fail"``: it compensates first if it has effects to undo) or undo its
    effects (``"compensate"``), without running its code; ``None``: no child failed, run it.
    The children move before the parent: a child's finish waits for the parent's row only
    at its commit, and this transaction takes that row last."""
    r = agent_runs
    if run.failed_child is None:  # woken by its join, its deadline: its code decides
        return None
    failed = yield select(r.c.id, r.c.idempotency_key, r.c.reason).where(
        r.c.id == run.failed_child)
    key = failed[0]["idempotency_key"].split("/", 1)[-1]
    note = f"child {key!r} failed: {failed[0]['reason']}"
    # Its unfinished children, as descendants of a cancel (none raises; one a worker holds
    # is left to end its step), locked the deepest first, then this run last (its move).
    yield from _lock_tree(run.id)  # one order for the whole tree, as cancel's
    yield from _cancel_below(run.id, root=run.id, actor=actor, reason=f"its sibling {note}",
                             settings=settings, notify=True, done=Cancelled([], [], []))
    evidence = {"child": str(failed[0]["id"]), "key": key, "on_failure": run.on_child_failure}
    if run.on_child_failure == "compensate":
        return (yield from compensation.begin_leased_plan(
            lease, reason=note, evidence=evidence, actor=actor, settings=settings))
    return (yield from transition_plan(lease, RunState.FAILED, step=None, reason=note,
                                       evidence=evidence, actor=actor, checkpoint=KEEP,
                                       wake_at=None, settings=settings))
