"""Operations whose outcome the ledger still expects to learn, by the message that caused them.

A consumer must not give up on (dead-letter) a message while an operation it started is
``pending``, ``unknown`` or ``not-applied``: the reconciler, or the message's next attempt,
will settle it, and what waits on it (the agent run) is settled with it. Dead-lettering in
between would leave the run waiting on a message nobody handles any more.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select

from dedup.ledger.operations import OPEN, Operation, fetch, ops
from outbox.db.execution import SyncConn
from outbox.settings import OutboxSettings

_OPEN_VALUES = sorted(s.value for s in OPEN)


def awaited_operation(
    conn: SyncConn, message_id: uuid.UUID | str, *, settings: OutboxSettings | None = None
) -> Operation | None:
    """The open operation of message *message_id* that is due to be checked first, if any.

    Only operations recorded with ``message_id=`` (as :meth:`dedup.ledger.Ledger.perform` does
    when it derives the key from the message) are found. Read-only; never commits.
    """
    # Open operations are few (the status index holds them); message_id narrows them down.
    query = (
        select(ops)
        .where(ops.c.status.in_(_OPEN_VALUES), ops.c.message_id == str(message_id))
        .order_by(ops.c.next_check_at.asc().nulls_first())
        .limit(1)
    )
    rows = fetch(conn, query, settings)
    return Operation.from_row(rows[0]) if rows else None
