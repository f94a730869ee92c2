"""A plain model of a run's state machine, to hold the database against.

Only what a test can observe is modelled: the state, the fencing token and version, who
holds the lease and whether it is live, when a run may wake, its checkpoint, how many
history rows it has, its confirmations and approvals. The legal moves come from
:data:`outbox.runs.states.ALLOWED` (tests/unit/test_runs_states.py holds that table to the spec);
every other rule is written out here from the documentation of :mod:`outbox.runs.lifecycle`,
:mod:`outbox.runs.confirm` and :mod:`outbox.runs.approvals`, not from their code.

Times are three-valued, because every example runs inside one transaction, where
``now()`` stands still: ``none`` (NULL), ``due`` (at or before now) and ``later`` (after).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, text

from outbox.runs.states import ALLOWED, RunState

RUNNING = RunState.RUNNING.value


@dataclass
class RunModel:
    id: uuid.UUID
    state: str = RunState.QUEUED.value
    token: int = 0  # lease_token: +1 per claim, never anything else
    version: int = 0  # +1 per write
    owner: str | None = None
    lease: str = "none"  # lease_expires_at: none | live | expired
    not_before: str = "none"  # none | due | later
    checkpoint: Any = None
    history: int = 1  # run_transitions rows ("started")
    confirmations: set[str] = field(default_factory=set)

    def claimable(self) -> bool:
        """What ``claim`` may pick: due queued, expired running, woken waiting runs."""
        return (
            (self.state == RunState.QUEUED and self.not_before != "later")
            or (self.state == RUNNING and self.lease != "live")
            or (self.state == RunState.WAITING and self.not_before == "due")
        )

    def leave_running(self, to: str) -> None:
        """A move out of ``running`` ends the lease (the token stays)."""
        self.state, self.owner, self.lease = to, None, "none"

    def observed(self) -> tuple[Any, ...]:
        return (self.state, self.token, self.version, self.owner, self.lease,
                self.not_before, self.checkpoint, self.history)


@dataclass
class ApprovalModel:
    run_id: uuid.UUID
    expired: bool
    granted: bool = False
    revoked: bool = False

    @property
    def pending(self) -> bool:
        return not (self.granted or self.revoked or self.expired)


def legal(from_state: str, to_state: str) -> bool:
    return RunState(to_state) in ALLOWED[RunState(from_state)]


def sources(to_state: str) -> set[str]:
    return {s.value for s, targets in ALLOWED.items() if RunState(to_state) in targets}


# One round trip per check: the runs, the confirmations and the approvals, as JSON.
_OBSERVE = text(
    """
    SELECT
      (SELECT coalesce(json_agg(json_build_array(
           r.id, r.state, r.lease_token, r.version, r.lease_owner,
           CASE WHEN r.lease_expires_at IS NULL THEN 'none'
                WHEN r.lease_expires_at > now() THEN 'live' ELSE 'expired' END,
           CASE WHEN r.not_before IS NULL THEN 'none'
                WHEN r.not_before <= now() THEN 'due' ELSE 'later' END,
           r.checkpoint,
           (SELECT count(*) FROM outboxkit.run_transitions t WHERE t.run_id = r.id))), '[]')
       FROM outboxkit.agent_runs r),
      (SELECT coalesce(json_agg(json_build_array(c.run_id, c.confirmation_id)), '[]')
       FROM outboxkit.confirmations c),
      (SELECT coalesce(json_agg(json_build_array(
           a.id, a.granted_at IS NOT NULL, a.revoked_at IS NOT NULL)), '[]')
       FROM outboxkit.approvals a)
    """
)


@dataclass(frozen=True)
class Observed:
    """What the database holds, in the shapes the models produce."""

    runs: dict[uuid.UUID, tuple[Any, ...]]
    confirmations: set[tuple[uuid.UUID, str]]
    approvals: dict[uuid.UUID, tuple[bool, bool]]


def observe(conn: Connection) -> Observed:
    runs, confirmations, approvals = conn.execute(_OBSERVE).one()
    return Observed(
        runs={uuid.UUID(r[0]): tuple(r[1:]) for r in runs},
        confirmations={(uuid.UUID(c[0]), c[1]) for c in confirmations},
        approvals={uuid.UUID(a[0]): (a[1], a[2]) for a in approvals},
    )
