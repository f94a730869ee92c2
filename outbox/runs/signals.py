"""Named signals: the outside world tells a run something ("payment-received", "cancel"),
once per signal id, in the sender's transaction.

* :func:`send_plan` (``app.signal``) keeps the signal until the run takes it; a run that
  waits for that name is woken (made claimable now). A signal to a run that does not wait
  for it is kept and taken when it does; one to a finished run is refused, nothing written.
  The same signal id twice is one signal (the second send returns False); the same id with
  another name or payload is refused.
* :func:`receive_plan` (``job.receive(name)``) takes the oldest signal of that name the run
  has not taken, in the step's transaction and fenced by its lease: a step that rolls back
  leaves it to the next attempt.
* :func:`wait_plan` (``job.wait_for_signal(...)``) moves the run to ``waiting`` for some
  names, until a deadline (then it is claimable again with no signal: the step decides what
  a timeout means). A signal of one of those names that is already there makes the run
  claimable at once instead of waiting.

Why no signal is missed between a step's look and its wait: the wait first locks the run's
row, and a send locks it too before it records anything. A send that committed before the
lock is seen by the wait's next statement (which makes the run claimable at once); a send
that comes after waits for the step's commit and then finds the run waiting for it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.db.execution import Plan
from outbox.db.tables import agent_runs, run_signals
from outbox.errors import ConfigurationError, IllegalTransition, RunNotFound
from outbox.runs import fencing, wakeups
from outbox.runs.checkpoints import KEEP, json_value
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import wake_value
from outbox.runs.states import FINISHED, RunState
from outbox.settings import OutboxSettings

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_WAITING = frozenset({RunState.WAITING.value})


@dataclass(frozen=True)
class Signal:
    """A signal as kept: to which run, its id, name and payload, who sent it and when;
    ``received_at`` once the run took it."""

    run_id: uuid.UUID
    signal_id: str
    name: str
    payload: Any
    sender: str
    sent_at: datetime
    received_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Signal:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


def check_name(name: Any) -> str:
    """*name* if it is a signal name (letters, digits, ``._:-``; at most 128), else raise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"a signal name is 1-128 letters, digits or '._:-', starting with a letter or "
            f"digit; got {name!r}")
    return name


def send_plan(run_id: uuid.UUID, name: str, payload: Any, *, signal_id: str, sender: str,
              accepted: Mapping[tuple[str, str], Collection[str]] | None = None,
              settings: OutboxSettings | None = None, notify: bool = True) -> Plan[bool]:
    """Keep signal *name* for run *run_id*; True if recorded, False if *signal_id* was.

    *accepted*: by (workflow, version), the signal names it declares, for the versions the
    sender knows (an :class:`outbox.App` that registered them); another name is refused for
    a run pinned to one of those.
    """
    check_name(name)
    if not isinstance(signal_id, str) or not signal_id:
        raise ConfigurationError("signal_id must be a non-empty string (the sender's id for "
                                 "this signal: sending it again sends nothing)")
    if not sender:
        raise ConfigurationError("sender must name who sends the signal")
    r, s = agent_runs, run_signals
    rows = yield (select(r.c.state, r.c.awaits_signals, r.c.purged_at, r.c.workflow,
                         r.c.workflow_version)
                  .where(r.c.id == run_id).with_for_update())
    if not rows:
        raise RunNotFound(run_id)
    run = rows[0]
    declared = (accepted or {}).get((run["workflow"], run["workflow_version"]))
    if declared is not None and name not in declared:
        raise ConfigurationError(
            f"workflow {run['workflow']!r} version {run['workflow_version']!r} takes no "
            f"signal {name!r} (it declares: {', '.join(sorted(declared)) or 'none'})")
    value = json_value(payload)
    # Compared as jsonb, both sides through the same serialiser: a retried send of the same
    # payload is the same signal whatever its key order, tuples or number formatting.
    prior = yield select(s.c.name, (s.c.payload == value).label("same")).where(
        s.c.run_id == run_id, s.c.signal_id == signal_id)
    if prior:
        return _duplicate(prior[0], run_id, signal_id, name)
    if run["state"] in FINISHED or run["purged_at"] is not None:
        raise IllegalTransition(run_id, run["state"], RunState.WAITING.value,
                                f"signal {name!r} cannot be delivered to a finished run")
    inserted = yield (pg_insert(s).values(run_id=run_id, signal_id=signal_id, name=name,
                                          payload=value, sender=sender)
                      .on_conflict_do_nothing(index_elements=[s.c.run_id, s.c.signal_id])
                      .returning(s.c.signal_id))
    if not inserted:  # a send of the same id committed meanwhile (REPEATABLE READ callers)
        prior = yield select(s.c.name, (s.c.payload == value).label("same")).where(
            s.c.run_id == run_id, s.c.signal_id == signal_id)
        return _duplicate(prior[0], run_id, signal_id, name)
    if run["state"] == RunState.WAITING and name in (run["awaits_signals"] or ()):
        stmt = fencing.statement(run_id, lease=None, sources=_WAITING,
                                 values={"not_before": func.now(), "awaits_signals": None},
                                 woken=wakeups.woken(settings) if notify else None)
        yield stmt
    return True


def _duplicate(prior: Mapping[Any, Any], run_id: uuid.UUID, signal_id: str, name: str) -> bool:
    if prior["name"] != name or not prior["same"]:
        raise ConfigurationError(
            f"signal id {signal_id!r} of run {run_id} was sent as {prior['name']!r} with "
            "another payload; a signal id names one signal")
    return False


def receive_plan(lease: Lease, name: str) -> Plan[Signal | None]:
    """Take the oldest signal *name* the run has not taken, fenced by *lease*."""
    check_name(name)
    s = run_signals
    yield from fencing.hold(lease)
    oldest = (select(s.c.signal_id).where(s.c.run_id == lease.run_id, s.c.name == name,
                                          s.c.received_at.is_(None))
              .order_by(s.c.sent_at, s.c.signal_id).limit(1).with_for_update()
              .scalar_subquery())
    rows = yield (update(s).where(s.c.run_id == lease.run_id, s.c.signal_id == oldest)
                  .values(received_at=func.now()).returning(*s.c))
    return Signal.from_row(rows[0]) if rows else None


def wait_plan(lease: Lease, names: Collection[str], *, until: datetime | timedelta | None,
              step: str | None, reason: str | None, actor: str | None,
              settings: OutboxSettings | None, checkpoint: Any = KEEP) -> Plan[Lease]:
    """Move the run to ``waiting`` for *names* (until *until*), or make it claimable at once
    when one of them is already there; ends the lease."""
    wanted = sorted({check_name(n) for n in names})
    if not wanted:
        raise ConfigurationError("wait_for_signal needs at least one signal name")
    r, s = agent_runs, run_signals
    # The row lock first: a send after it waits for this transaction (see the module's doc);
    # then a fresh statement sees every send that committed before it.
    yield select(r.c.id).where(r.c.id == lease.run_id).with_for_update()
    rows = yield select(exists(select(s.c.signal_id).where(
        s.c.run_id == lease.run_id, s.c.name.in_(wanted), s.c.received_at.is_(None)
    )).label("pending"))
    pending = bool(rows[0]["pending"])
    note = reason or f"waits for signal {' or '.join(wanted)}"
    return (yield from fencing.wait_plan(
        lease, ready=pending, until=wake_value(until, aware=True),
        waits={"awaits_signals": None if pending else wanted}, note=note, step=step,
        checkpoint=checkpoint, actor=actor, settings=settings))
