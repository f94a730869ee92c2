"""An outside system as the ledger sees it: how to call it and how to ask what happened.

Both functions receive the :class:`~dedup.ledger.operations.Operation` (its ``idempotency_key``
must go with the call; ``request`` is what to send). An exception from either is read as
:class:`~dedup.ledger.outcomes.Unclear`: a timeout says nothing about whether the call was applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from dedup.ledger.operations import Operation, mark_unknown, record_outcome
from dedup.ledger.outcomes import (
    Applied,
    CallOutcome,
    Found,
    NotFound,
    Refused,
    StatusOutcome,
    Unclear,
)
from dedup.ledger.policy import ReconcilePolicy
from outbox.runtime.failpoints import failpoint
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class System:
    """*call* sends the operation (with its idempotency key); *status_query* looks it up by
    that key (or id) and answers Found / NotFound / Unclear."""

    name: str
    call: Callable[[Operation], CallOutcome]
    status_query: Callable[[Operation], StatusOutcome]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def invoke(system: System, operation: Operation) -> CallOutcome:
    """Call *system*; any exception or unexpected answer becomes :class:`Unclear`."""
    try:
        outcome = system.call(operation)
    except Exception as exc:
        return Unclear(_describe(exc))
    failpoint("operations.after_call")
    if isinstance(outcome, Applied | Refused | Unclear):
        return outcome
    return Unclear(f"call returned {outcome!r}, not Applied/Refused/Unclear")


def ask(system: System, operation: Operation) -> StatusOutcome:
    """Query *system*'s status; any exception or unexpected answer becomes :class:`Unclear`."""
    try:
        answer = system.status_query(operation)
    except Exception as exc:
        return Unclear(_describe(exc))
    if isinstance(answer, Found | NotFound | Unclear):
        return answer
    return Unclear(f"status query returned {answer!r}, not Found/NotFound/Unclear")


def send(
    engine: Engine,
    operation: Operation,
    system: System,
    *,
    policy: ReconcilePolicy,
    actor: str,
    settings: OutboxSettings | None = None,
) -> Operation:
    """Make the call for an operation whose ``pending`` intent is committed; record what came
    back in a transaction of its own.

    If recording fails (database unreachable) or the process dies here, the operation stays
    ``pending`` and a reconciler settles it by status query after ``in_flight_grace``.
    """
    outcome = invoke(system, operation)
    with engine.begin() as conn:
        if isinstance(outcome, Unclear):
            log.warning(
                "operation %s (%s) outcome unknown: %s", operation.id, operation.idempotency_key,
                outcome.reason, extra={"event": "dedup.operation_unknown"},
            )
            return mark_unknown(conn, operation.id, reason=outcome.reason,
                                check_in=policy.backoff(0), actor=actor, settings=settings)
        return record_outcome(conn, operation.id, outcome, actor=actor, settings=settings)
