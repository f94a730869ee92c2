"""Deleting published rows once they are old enough: whole id ranges, one relay at a time.

The relay never deletes a row as it publishes it; retention removes ranges of ids, oldest
first, keeping every row its lane's cursor has not passed yet (``outbox_passed``): a row still
to be published, or of a lane behind, stays whatever its age. Rows of transactions still
running are invisible to the DELETE and so never touched. The broker's proof
(``deliveries``) goes by the same age. Refused rows stay in ``outbox_failures`` (a copy)
until an operator retries them.
"""

from __future__ import annotations

from sqlalchemy import Engine

from relay.sql import sql

# Any constant works; it only has to be the same for every relay of one database.
RETENTION_LOCK = 0x6F7574626F78  # "outbox"

OLDEST = "SELECT min(id) FROM {schema}.outbox_messages"

# One range of ids; old rows that are not passed yet (a lane behind, a late commit) stay.
PURGE_RANGE = """
WITH gone AS (
    DELETE FROM {schema}.outbox_messages AS m
    USING {schema}.relay_lanes AS l
    WHERE m.id >= :lo AND m.id < :hi AND l.lane = m.lane
      AND m.created_at < now() - make_interval(secs => :older_than)
      AND {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot, l.batch_pos)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, n.id AS next_id,
       n.created_at < now() - make_interval(secs => :older_than) AS next_old
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (SELECT m.id, m.created_at FROM {schema}.outbox_messages AS m
                   WHERE m.id >= :hi ORDER BY m.id LIMIT 1) AS n ON true
"""

PURGE_DELIVERIES = """
DELETE FROM {schema}.deliveries
WHERE id < coalesce((SELECT min(id) FROM {schema}.deliveries
                     WHERE published_at >= now() - make_interval(secs => :older_than)),
                    (SELECT max(id) + 1 FROM {schema}.deliveries))
"""


def purge_published(
    engine: Engine, schema: str, *, older_than_s: float, batch: int, max_batches: int = 100
) -> int:
    """Delete published rows older than *older_than_s*, *batch* ids at a time; return how many.

    Each range is its own short transaction, from the oldest id up to the first row that is
    not old enough (ids follow time closely enough for that). Only the relay holding the
    retention lock does the work; the others return 0.
    """
    deleted = 0
    with engine.connect() as conn:
        lo = conn.execute(sql(OLDEST, schema)).scalar()
    if lo is None:
        return 0
    for _ in range(max_batches):
        with engine.begin() as conn:
            got_lock = conn.execute(
                sql("SELECT pg_try_advisory_xact_lock(:k)", schema), {"k": RETENTION_LOCK}
            ).scalar_one()
            if not got_lock:
                return deleted
            row = conn.execute(
                sql(PURGE_RANGE, schema),
                {"lo": lo, "hi": lo + batch, "older_than": older_than_s},
            ).one()
        deleted += int(row.deleted)
        if row.next_id is None or not row.next_old:
            break
        lo = int(row.next_id)  # over any gap in the ids (rolled-back transactions)
    with engine.begin() as conn:
        conn.execute(sql(PURGE_DELIVERIES, schema), {"older_than": older_than_s})
    return deleted
