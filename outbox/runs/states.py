"""The states of an agent run and the only moves between them."""

from __future__ import annotations

from enum import StrEnum
from uuid import UUID

from outbox.errors import IllegalTransition


class RunState(StrEnum):
    """Where a run is. ``done`` is terminal; the others can still move (see :data:`ALLOWED`)."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"
    NEEDS_HUMAN = "needs-human"


ALLOWED: dict[RunState, frozenset[RunState]] = {
    # queued → failed: cancelled before any worker took it.
    RunState.QUEUED: frozenset({RunState.RUNNING, RunState.FAILED}),
    RunState.RUNNING: frozenset(
        {RunState.WAITING, RunState.DONE, RunState.FAILED, RunState.NEEDS_HUMAN}
    ),
    RunState.WAITING: frozenset({RunState.RUNNING, RunState.FAILED, RunState.NEEDS_HUMAN}),
    RunState.FAILED: frozenset({RunState.QUEUED, RunState.NEEDS_HUMAN}),
    # needs-human → waiting: a person resolved the operation the run was escalated for, and
    # the run waits again for that operation's outcome (the ledger then confirms it).
    RunState.NEEDS_HUMAN: frozenset({RunState.QUEUED, RunState.WAITING, RunState.FAILED}),
    RunState.DONE: frozenset(),
}
"""Every allowed move, and nothing else: ``ALLOWED[from]`` is the set of reachable states."""

# States in which nobody holds a lease: a worker leaves them only through a claim.
UNLEASED = frozenset(
    {RunState.QUEUED, RunState.WAITING, RunState.DONE, RunState.FAILED, RunState.NEEDS_HUMAN}
)
# States that stamp finished_at: the run stopped and only a human (requeue) restarts it.
FINISHED = frozenset({RunState.DONE, RunState.FAILED})


def is_allowed(from_state: RunState | str, to_state: RunState | str) -> bool:
    """True when the table allows *from_state* → *to_state*."""
    return RunState(to_state) in ALLOWED[RunState(from_state)]


def sources(to_state: RunState | str) -> frozenset[RunState]:
    """The states from which *to_state* can be reached."""
    target = RunState(to_state)
    return frozenset(state for state, targets in ALLOWED.items() if target in targets)


def check(from_state: RunState | str, to_state: RunState | str, run_id: UUID | None = None) -> None:
    """Raise :class:`IllegalTransition` unless the table allows the move."""
    if not is_allowed(from_state, to_state):
        raise IllegalTransition(run_id, str(from_state), str(to_state))
