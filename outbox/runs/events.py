"""A run's events, for a front end that follows it: numbered in commit order, resumable.

Every committed change of a run is an event with a number (``seq``: 1, 2, 3... per run):
its moves, its log entries (a durable agent's model responses and tool results), the
messages it emitted, the confirmations of them, its approvals asked for, granted, revoked
and spent. Triggers number them at the writing transaction's commit (migration 0019 says
how, and why that is commit order), so:

* what did not commit is never an event, even for a moment (a rolled-back step never shows);
* a reader that saw every event up to *N* gets all the others, each once, by asking for
  those after *N* (:func:`run_events` with ``after=N``; a stream's ``Last-Event-ID``): a
  writer that committed late was numbered late, never below a number already read.

An event holds a reference to its source row, read when the event is: its ``data`` is a
small summary of that row as it is now (a log entry's operation and the first
:data:`SUMMARY_CHARS` characters of its result; never a message's payload). A log entry a
save wrote again is a second event showing the entry's content (both then show the new
one). Retention (:mod:`outbox.runs.retention`) deletes a purged run's events.

:func:`follow_run_events` is the stream: every event after *after*, then each new one as it
commits (a read every *poll* seconds, one index range), until the run is finished.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy import Engine, RowMapping, Text, and_, cast, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db.execution import Plan, SyncConn, run_plan, run_plan_async
from outbox.db.tables import (
    agent_runs,
    approvals,
    confirmations,
    outbox_messages,
    run_log,
    run_transitions,
)
from outbox.db.tables import run_events as run_events_table
from outbox.errors import ConfigurationError, RunNotFound
from outbox.runs.states import FINISHED, RunState
from outbox.settings import OutboxSettings

KINDS: Final = ("state", "model_response", "tool_result", "log", "effect_sent",
                "effect_confirmed", "approval_requested", "approval_granted",
                "approval_revoked", "approval_spent")
"""Every event kind. ``log``: a run log entry that is neither a model response nor a tool
result (an ``op`` of another name, or an entry of another shape)."""

SUMMARY_CHARS: Final = 200
"""How much of a log entry's result (or an approval's scope) an event shows, as JSON text."""

_APPROVALS = ("approval_requested", "approval_granted", "approval_revoked", "approval_spent")
MAX_LIMIT: Final = 1000
DEFAULT_POLL: Final = 0.5


@dataclass(frozen=True)
class RunEvent:
    """One committed event of a run: its number, its kind (:data:`KINDS`), when its
    transaction began, and a small JSON summary of what happened (docs/workflows.md lists
    each kind's fields)."""

    run_id: uuid.UUID
    seq: int
    kind: str
    at: datetime
    data: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """As JSON would show it (what the console's stream sends; the time in UTC)."""
        return {"seq": self.seq, "kind": self.kind, "at": self.at.astimezone(UTC).isoformat(),
                "data": self.data}


def log_kind(op: str | None) -> str:
    """The kind of a log entry by its operation's name: the one thing read from it."""
    if op is None:
        return "log"
    if "model.request" in op:
        return "model_response"
    if "call_tool" in op:
        return "tool_result"
    return "log"


def events_plan(run_id: uuid.UUID, *, after: int, limit: int) -> Plan[list[RunEvent]]:
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise ConfigurationError(f"after is an event number >= 0, got {after!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit is between 1 and {MAX_LIMIT}, got {limit!r}")
    e, t, lg, m, c, a = (run_events_table, run_transitions, run_log, outbox_messages,
                         confirmations, approvals)
    result = func.coalesce(lg.c.entry.op("->")("result"), lg.c.entry)
    shown = func.left(cast(result, Text), SUMMARY_CHARS + 1)
    scope = func.left(cast(a.c.scope, Text), SUMMARY_CHARS + 1)
    # Each source joined only for its kind, by its key; an approval by its run first (few
    # per run), its id compared as text (ref_key also holds confirmation ids, not uuids).
    joined = (
        e.outerjoin(t, and_(e.c.kind == "state", t.c.id == e.c.ref))
        .outerjoin(lg, and_(e.c.kind == "log", lg.c.run_id == e.c.run_id,
                            lg.c.seq == e.c.ref))
        .outerjoin(m, and_(e.c.kind == "effect_sent", m.c.id == e.c.ref))
        .outerjoin(c, and_(e.c.kind == "effect_confirmed", c.c.run_id == e.c.run_id,
                           c.c.confirmation_id == e.c.ref_key))
        .outerjoin(a, and_(e.c.kind.in_(_APPROVALS), a.c.run_id == e.c.run_id,
                           cast(a.c.id, Text) == e.c.ref_key))
    )
    rows = yield (
        select(
            e.c.seq, e.c.kind, e.c.at, e.c.ref, e.c.ref_key,
            t.c.id.label("t_id"), t.c.from_state, t.c.to_state, t.c.step,
            t.c.reason.label("t_reason"), t.c.actor.label("t_actor"),
            lg.c.seq.label("log_seq"), lg.c.entry.op("->>")("op").label("op"),
            shown.label("shown"),
            m.c.id.label("m_id"), m.c.topic, m.c.message_type, m.c.key,
            c.c.confirmation_id, c.c.outcome, c.c.actor.label("c_actor"),
            a.c.id.label("a_id"), a.c.expires_at, a.c.granted_by, a.c.revoked_by,
            a.c.reason.label("a_reason"), a.c.grant_reason, a.c.spent_message_id,
            scope.label("scope"),
        )
        .select_from(joined)
        .where(e.c.run_id == run_id, e.c.seq > after)
        .order_by(e.c.seq)
        .limit(limit)
    )
    return [_event(run_id, row) for row in rows]


def _short(text: str | None) -> dict[str, Any]:
    if text is None:
        return {"summary": None}
    return {"summary": text[:SUMMARY_CHARS], "truncated": len(text) > SUMMARY_CHARS}


def _key(raw: bytes | None) -> str | None:
    return None if raw is None else bytes(raw)[:100].decode("utf-8", "replace")


# Per stored kind: what names the source row (kept when the row is gone), the column that is
# NULL when the row was deleted since (the relay's retention drops published outbox rows),
# and the summary of the row.
_APPROVAL: tuple[tuple[str, str], ...] = (("approval_id", "ref_key"),)
_SOURCES: dict[str, tuple[tuple[tuple[str, str], ...], str,
                          Callable[[RowMapping], dict[str, Any]]]] = {
    "state": ((), "t_id", lambda r: {
        "from": r["from_state"], "to": r["to_state"], "step": r["step"],
        "reason": r["t_reason"], "actor": r["t_actor"]}),
    "log": ((("log_seq", "ref"),), "log_seq", lambda r: {
        "op": r["op"], **_short(r["shown"])}),
    "effect_sent": ((("message_id", "ref_key"),), "m_id", lambda r: {
        "topic": r["topic"], "type": r["message_type"], "key": _key(r["key"])}),
    "effect_confirmed": ((("confirmation_id", "ref_key"),), "confirmation_id", lambda r: {
        "outcome": r["outcome"], "actor": r["c_actor"]}),
    "approval_requested": (_APPROVAL, "a_id", lambda r: {
        "expires_at": r["expires_at"].isoformat(), **_short(r["scope"])}),
    "approval_granted": (_APPROVAL, "a_id", lambda r: {
        "by": r["granted_by"], "reason": r["grant_reason"]}),
    "approval_revoked": (_APPROVAL, "a_id", lambda r: {
        "by": r["revoked_by"], "reason": r["a_reason"]}),
    "approval_spent": (_APPROVAL, "a_id", lambda r: {
        "message_id": None if r["spent_message_id"] is None else str(r["spent_message_id"])}),
}


def _event(run_id: uuid.UUID, row: RowMapping) -> RunEvent:
    kind = row["kind"]
    names, present, summary = _SOURCES[kind]
    data: dict[str, Any] = {name: row[column] for name, column in names}
    data.update(summary(row) if row[present] is not None else {"gone": True})
    if kind == "log":
        kind = log_kind(row["op"])
    return RunEvent(run_id=run_id, seq=row["seq"], kind=kind, at=row["at"], data=data)


def page_plan(run_id: uuid.UUID, *, after: int, limit: int
              ) -> Plan[tuple[RunState, list[RunEvent]]]:
    """The run's state, then its events after *after*: read in this order, the events
    include every one its transaction committed with that state (a finished run's last
    events too). :class:`RunNotFound` if there is no such run."""
    rows = yield select(agent_runs.c.state).where(agent_runs.c.id == run_id)
    if not rows:
        raise RunNotFound(run_id)
    events = yield from events_plan(run_id, after=after, limit=limit)
    return RunState(rows[0]["state"]), events


def run_events(conn: SyncConn, run_id: uuid.UUID, *, after: int = 0, limit: int = 100,
               settings: OutboxSettings | None = None) -> list[RunEvent]:
    """The run's committed events numbered after *after*, in order, at most *limit*
    (1..1000); none for an unknown run. Reads only."""
    return run_plan(conn, events_plan(run_id, after=after, limit=limit), settings)


async def follow_run_events(engine: Engine | AsyncEngine, run_id: uuid.UUID, *,
                            after: int = 0, poll: float = DEFAULT_POLL, limit: int = 100,
                            settings: OutboxSettings | None = None,
                            ) -> AsyncGenerator[RunEvent, None]:
    """Every committed event of the run after *after*, then each one as it commits, until
    the run is finished (``done`` or ``failed``; a cancelled run is failed) and its events
    so far were all yielded. :class:`RunNotFound` at once for an unknown run.

    Each read is a transaction of its own on *engine* (a sync engine's in a thread): the
    run's state, then up to *limit* events by index. Nothing wakes it: it reads again every
    *poll* seconds (at once while a read fills *limit*), so a follower costs one small read
    per *poll*, and sees an event at most *poll* seconds after its commit. Stop early by
    leaving the loop (``break``; ``aclose()`` for an iterator you hold).
    """
    if poll <= 0:
        raise ConfigurationError(f"poll is a number of seconds > 0, got {poll!r}")
    while True:
        state, events = await _read_page(engine, run_id, after, limit, settings)
        for event in events:
            yield event
            after = event.seq
        if len(events) == limit:
            continue
        if state in FINISHED:
            return
        await asyncio.sleep(poll)


async def _read_page(engine: Engine | AsyncEngine, run_id: uuid.UUID, after: int, limit: int,
                     settings: OutboxSettings | None) -> tuple[RunState, list[RunEvent]]:
    plan = page_plan(run_id, after=after, limit=limit)
    if isinstance(engine, AsyncEngine):
        async with engine.connect() as conn:
            return await run_plan_async(conn, plan, settings)

    def read() -> tuple[RunState, list[RunEvent]]:
        with engine.connect() as conn:
            return run_plan(conn, plan, settings)

    return await asyncio.to_thread(read)
