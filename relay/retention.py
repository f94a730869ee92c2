"""Deleting published rows once they are old enough: batched, and one relay at a time.

Dead rows at the head of the pending index slow every claim, so published rows must go
steadily; small batches with SKIP LOCKED hold no long locks and never fight the claim.
"""

from __future__ import annotations

from sqlalchemy import Engine

from relay.sql import sql

# Any constant works; it only has to be the same for every relay of one database.
RETENTION_LOCK = 0x6F7574626F78  # "outbox"

PURGE = """
WITH doomed AS (
    SELECT id FROM {schema}.outbox_messages
    WHERE status = 'published' AND published_at < now() - make_interval(secs => :older_than)
    ORDER BY published_at
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.outbox_messages AS m USING doomed WHERE m.id = doomed.id
"""


def purge_published(
    engine: Engine, schema: str, *, older_than_s: float, batch: int, max_batches: int = 100
) -> int:
    """Delete published rows older than *older_than_s*; returns how many went.

    Each batch is its own short transaction. Only the relay holding the retention lock
    does the work; the others return 0 at once.
    """
    deleted = 0
    for _ in range(max_batches):
        with engine.begin() as conn:
            got_lock = conn.execute(
                sql("SELECT pg_try_advisory_xact_lock(:k)", schema), {"k": RETENTION_LOCK}
            ).scalar_one()
            if not got_lock:
                return deleted
            count = conn.execute(
                sql(PURGE, schema), {"older_than": older_than_s, "batch": batch}
            ).rowcount
        deleted += count
        if count < batch:
            break
    return deleted
