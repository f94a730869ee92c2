"""Deleting published rows once they are old enough: whole id ranges, one relay at a time.

The relay never deletes a row as it publishes it; retention removes ranges of ids, oldest
first, keeping every row its lane's cursor has not passed yet (``outbox_passed``): a row still
to be published, or of a lane behind, stays whatever its age. Rows of transactions still
running are invisible to the DELETE and so never touched. The broker's proof
(``deliveries``) goes by the same age. Refused rows stay in ``outbox_failures`` (a copy)
until an operator retries them.
"""

from __future__ import annotations

from outbox.db.pool import Pool, one, scalar
from outbox.db.queries import driver_sql

# Any constant works; it only has to be the same for every relay of one database.
RETENTION_LOCK = 0x6F7574626F78  # "outbox"


def purge_published(
    pool: Pool, schema: str, *, older_than_s: float, batch: int, max_batches: int = 100
) -> int:
    """Delete published rows older than *older_than_s*, *batch* ids at a time; return how many.

    Each range is its own short transaction, from the oldest id up to the first row that is
    not old enough (ids follow time closely enough for that). Only the relay holding the
    retention lock does the work; the others return 0.
    """
    deleted = 0
    with pool.connection() as conn:
        lo = scalar(conn, driver_sql("relay", "oldest_message", schema))
    if lo is None:
        return 0
    for _ in range(max_batches):
        with pool.begin() as conn:
            got_lock = scalar(conn, driver_sql("relay", "retention_lock", schema),
                              {"k": RETENTION_LOCK})
            if not got_lock:
                return deleted
            row = one(conn, driver_sql("relay", "purge_range", schema),
                      {"lo": lo, "hi": lo + batch, "older_than": older_than_s})
        deleted += int(row.deleted)
        if row.next_id is None or not row.next_old:
            break
        lo = int(row.next_id)  # over any gap in the ids (rolled-back transactions)
    with pool.begin() as conn:
        conn.execute(driver_sql("relay", "purge_deliveries", schema), {"older_than": older_than_s})
    return deleted
