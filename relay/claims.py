"""Reading the backlog of owned lanes and recording what Kafka acknowledged.

Rows are claimed by state (``pending``), never by a high-water mark: a row committed late
with a lower id than rows already published is still pending, so the next claim finds it.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from relay.sql import sql

# One index range scan per lane (lane, id) over the partial index of pending rows. The join
# on relay_lanes fences the claim: a relay whose lane was taken over (token moved on)
# claims nothing there. There is deliberately no outer ORDER BY: the nested loop over the
# lanes then stops as soon as the limit's rows came out, instead of reading up to that many rows
# of every owned lane and sorting them all (80 ms for 64 lanes with a backlog, against a
# few ms). Order within a lane does not depend on the plan: ``rn`` numbers each lane's
# rows, and claim() keeps only an unbroken prefix 1..k of every lane.
CLAIM = """
SELECT o.pos, m.rn, m.id, m.message_id, m.topic, m.key, m.message_type, m.payload,
       m.headers, m.created_at, m.lane, m.attempts
FROM unnest(CAST(%(lanes)s AS int[]), CAST(%(tokens)s AS bigint[]))
     WITH ORDINALITY AS o(lane, token, pos)
JOIN {schema}.relay_lanes AS l
  ON l.lane = o.lane AND l.token = o.token AND l.owner = %(relay_id)s AND l.expires_at > now()
CROSS JOIN LATERAL (
    SELECT p.*, row_number() OVER (ORDER BY p.id) AS rn FROM (
        SELECT * FROM {schema}.outbox_messages AS m
        WHERE m.lane = o.lane AND m.status = 'pending'
          AND m.id <> ALL(CAST(%(exclude)s AS bigint[]))
          AND NOT EXISTS (
              SELECT 1 FROM {schema}.outbox_messages AS f
              WHERE f.status = 'failed' AND f.blocking AND f.lane = m.lane
                AND f.topic = m.topic AND f.key = m.key AND f.id < m.id)
        ORDER BY m.id
        LIMIT %(limit)s
    ) AS p
) AS m
LIMIT %(limit)s
"""

MARK_PUBLISHED = """
UPDATE {schema}.outbox_messages AS m
SET status = 'published', published_at = now(), attempts = m.attempts + 1,
    kafka_partition = v.partition, kafka_offset = v.kafka_offset, last_error = NULL
FROM unnest(CAST(:ids AS bigint[]), CAST(:partitions AS int[]), CAST(:offsets AS bigint[]))
     AS v(id, partition, kafka_offset)
WHERE m.id = v.id AND m.status = 'pending'
"""

MARK_FAILED = """
UPDATE {schema}.outbox_messages AS m
SET status = 'failed', attempts = m.attempts + 1, last_error = v.error, failed_at = now(),
    blocking = v.blocking, kafka_partition = v.partition, kafka_offset = v.kafka_offset
FROM unnest(CAST(:ids AS bigint[]), CAST(:errors AS text[]), CAST(:blocking AS bool[]),
            CAST(:partitions AS int[]), CAST(:offsets AS bigint[]))
     AS v(id, error, blocking, partition, kafka_offset)
WHERE m.id = v.id AND m.status = 'pending'
"""

NOTE_TRANSIENT = """
UPDATE {schema}.outbox_messages SET attempts = attempts + 1, last_error = :error
WHERE id = ANY(CAST(:ids AS bigint[])) AND status = 'pending'
"""


@dataclass(frozen=True)
class OutboxRow:
    id: int
    message_id: uuid.UUID
    topic: str
    key: bytes | None
    message_type: str
    payload: bytes
    headers: dict[str, Any]
    created_at: datetime
    lane: int
    attempts: int


@dataclass(frozen=True)
class Published:
    row: OutboxRow
    partition: int
    offset: int


@dataclass(frozen=True)
class Failed:
    row: OutboxRow
    error: str
    permanent: bool
    # Where the dead-letter copy landed, when there is one.
    partition: int | None = None
    offset: int | None = None


def claim(
    conn: Connection,
    schema: str,
    *,
    relay_id: str,
    lanes: dict[int, int],
    limit: int,
    rotate: int = 0,
    exclude: Sequence[int] = (),
) -> list[OutboxRow]:
    """Up to *limit* pending rows of the owned *lanes*, each lane's rows in id order.

    *rotate* shifts which lane is read first, so a busy lane cannot starve the others.
    *exclude* names rows already acknowledged whose marking is still in progress. It is a
    list of ids, never an "above this id" mark: a row committed late with a lower id is
    not in the list, so it is claimed (before the later rows of its key).
    """
    if not lanes:
        return []
    order = sorted(lanes)
    shift = rotate % len(order)
    order = order[shift:] + order[:shift]
    # Executed through SQLAlchemy, so a database error is a SQLAlchemyError (the loop backs
    # off on those) and a dropped connection is invalidated; but the rows are read from the
    # driver's cursor as plain tuples: decoding a thousand Row objects cost a sixth of the
    # relay's loop.
    result = conn.exec_driver_sql(
        _claim_sql(schema),
        {
            "lanes": order,
            "tokens": [lanes[lane] for lane in order],
            "relay_id": relay_id,
            "limit": limit,
            "exclude": list(exclude),
        },
    )
    try:
        fetched = result.cursor.fetchall()
    finally:
        result.close()
    return [
        OutboxRow(
            r[2], r[3], r[4], bytes(r[5]) if r[5] is not None else None, r[6], bytes(r[7]),
            r[8] or {}, r[9], r[10], r[11],
        )
        for r in _lane_prefixes(fetched)
    ]


@functools.cache
def _claim_sql(schema: str) -> str:
    return CLAIM.replace("{schema}", f'"{schema}"')  # a validated identifier, see relay.sql


def _lane_prefixes(fetched: Sequence[Any]) -> list[Any]:
    """The rows in (lane position, id) order, each lane cut at its first missing row number.

    Row numbers count each lane's pending rows from 1 in id order; a lane whose rows came
    back as 1, 2, 4 (a plan that stopped mid-way differently) keeps 1, 2: row 3 must be sent
    before row 4, and both are claimed again next time.
    """
    kept: list[Any] = []
    expected: dict[int, int] = {}
    for row in sorted(fetched, key=lambda r: (r[0], r[1])):
        pos, rn = row[0], row[1]
        if expected.get(pos, 1) != rn:
            expected[pos] = -1  # a gap: nothing more from this lane
            continue
        expected[pos] = rn + 1
        kept.append(row)
    return kept


def record(
    conn: Connection,
    schema: str,
    published: list[Published],
    failed: list[Failed],
    *,
    blocking: bool,
) -> None:
    """Mark acknowledged rows published (with partition and offset) and refused rows failed."""
    if published:
        conn.execute(
            sql(MARK_PUBLISHED, schema),
            {
                "ids": [p.row.id for p in published],
                "partitions": [p.partition for p in published],
                "offsets": [p.offset for p in published],
            },
        )
    permanent = [f for f in failed if f.permanent]
    if permanent:
        conn.execute(
            sql(MARK_FAILED, schema),
            {
                "ids": [f.row.id for f in permanent],
                "errors": [f.error[:2000] for f in permanent],
                "blocking": [blocking and f.offset is None for f in permanent],
                "partitions": [f.partition for f in permanent],
                "offsets": [f.offset for f in permanent],
            },
        )
    transient = [f for f in failed if not f.permanent]
    if transient:
        conn.execute(
            sql(NOTE_TRANSIENT, schema),
            {
                "ids": [f.row.id for f in transient],
                "error": transient[0].error[:2000],
            },
        )
