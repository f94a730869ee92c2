"""Reading the next rows of owned lanes from the outbox log, and recording what Kafka said.

The relay never updates or deletes an outbox row: it reads snapshot differences (see
relay/cursors.py) and, once Kafka acknowledged a batch, writes one ``deliveries`` row per
lane (the ids with their partitions and offsets) and moves the lanes' cursors, in one
statement, fenced by the lanes' tokens. Refused rows are copied to ``outbox_failures``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from json import dumps, loads
from typing import Any

from sqlalchemy import Connection

from relay.cursors import Cursor, LaneRead
from relay.sql import sql

# Per owned lane (fenced by the join on relay_lanes: a relay whose lane was taken over reads
# nothing there), the next rows of the lane's difference, in two parts, each through an index
# and in id order:
#   b. a range of (lane, id) from lo to hi, the smallest and largest id of the rows of
#      transactions that started after the cursor (xid >= its xmax), computed once per target
#      from (lane, xid) and then passed back by the relay; the filter is the whole difference
#      (visible in the target, not in the cursor), so it also takes the rows of transactions
#      that were running at the cursor when their ids fall in the range;
#   a. the rest of those: rows of the cursor's running transactions (its xip list, a probe
#      on (lane, xid) each) outside the range; they may have low ids (a late commit).
# The relay merges the two by id (claims._reads). A lane the relay knows nothing about (first
# read, or its token changed) starts from the cursor stored in relay_lanes. There is no ORDER
# BY across lanes: the nested loop over the lanes stops as soon as the limit's rows came out.
CLAIM = """
WITH c AS MATERIALIZED (
    SELECT o.ord, o.lane, o.token,
           CASE WHEN o.known THEN CAST(o.snap AS pg_snapshot) ELSE l.cursor_snapshot END AS snap,
           coalesce(CASE WHEN o.known THEN CAST(o.target AS pg_snapshot) ELSE l.batch_snapshot END,
                    pg_current_snapshot()) AS target,
           CASE WHEN o.known THEN o.pos ELSE l.batch_pos END AS pos,
           o.floor, o.ceil
    FROM unnest(CAST(%(lanes)s AS int[]), CAST(%(tokens)s AS bigint[]),
                CAST(%(known)s AS bool[]), CAST(%(snaps)s AS text[]),
                CAST(%(targets)s AS text[]), CAST(%(pos)s AS bigint[]),
                CAST(%(floors)s AS bigint[]), CAST(%(ceils)s AS bigint[]))
         WITH ORDINALITY AS o(lane, token, known, snap, target, pos, floor, ceil, ord)
    JOIN {schema}.relay_lanes AS l
      ON l.lane = o.lane AND l.token = o.token AND l.owner = %(relay_id)s
     AND l.expires_at > now()
),
b AS (
    SELECT c.*, coalesce(c.floor, r.lo, 0) AS lo, coalesce(c.ceil, r.hi, -1) AS hi
    FROM c
    LEFT JOIN LATERAL (
        -- "+ 0": an aggregate, not the planner's min/max shortcut, which would walk the lane's
        -- (lane, id) index from its oldest row instead of the (lane, xid) range.
        SELECT min(m.id + 0) AS lo, max(m.id + 0) AS hi FROM {schema}.outbox_messages AS m
        WHERE c.floor IS NULL AND m.lane = c.lane
          AND m.xid >= pg_snapshot_xmax(c.snap) AND m.xid < pg_snapshot_xmax(c.target)
          AND pg_visible_in_snapshot(m.xid, c.target)
    ) AS r ON true
)
SELECT b.ord, b.lane, CAST(b.snap AS text), CAST(b.target AS text), b.pos, b.lo, b.hi,
       p.part, p.got, p.id, p.message_id, p.topic, p.key, p.message_type, p.payload,
       CAST(p.headers AS text), p.created_at, p.run_id,
       -- Whether to read outbox_failures too (a blocked key, a retry): almost never.
       EXISTS (SELECT 1 FROM {schema}.outbox_failures AS f
               WHERE f.lane = ANY(CAST(%(lanes)s AS int[]))
                 AND (f.state <> 'failed' OR f.blocking)) AS failures
FROM b
LEFT JOIN LATERAL (
    -- Part a first: when the outer LIMIT cuts a lane, what is missing is then its part b,
    -- or part b and the end of part a; claims._reads knows which (see there).
    (SELECT 'a' AS part, count(*) OVER () AS got, q.* FROM (
        SELECT m.id, m.message_id, m.topic, m.key, m.message_type, m.payload, m.headers,
               m.created_at, m.run_id
        FROM unnest(ARRAY(SELECT pg_snapshot_xip(b.snap))) AS x(xid)
        CROSS JOIN LATERAL (  -- a (lane, xid) probe per running transaction
            SELECT * FROM {schema}.outbox_messages AS r
            WHERE r.lane = b.lane AND r.xid = x.xid AND pg_visible_in_snapshot(r.xid, b.target)
            OFFSET 0  -- kept a subquery: a probe per transaction, never a scan of the lane
        ) AS m
        WHERE (m.id < b.lo OR m.id > b.hi) AND m.id > b.pos
        ORDER BY m.id LIMIT %(more)s) AS q)
    UNION ALL
    (SELECT 'b' AS part, count(*) OVER () AS got, q.* FROM (
        SELECT m.id, m.message_id, m.topic, m.key, m.message_type, m.payload, m.headers,
               m.created_at, m.run_id
        FROM {schema}.outbox_messages AS m
        -- Row comparisons (they pin the lane too): the (lane, id) index serves them in the
        -- order asked for, so the scan stops at the limit.
        WHERE b.lo <= b.hi  -- no such rows: no scan at all
          AND (m.lane, m.id) >= (b.lane, greatest(b.pos + 1, b.lo))
          AND (m.lane, m.id) <= (b.lane, b.hi)
          AND pg_visible_in_snapshot(m.xid, b.target)
          AND NOT pg_visible_in_snapshot(m.xid, b.snap)
        ORDER BY m.lane, m.id LIMIT %(more)s) AS q)
) AS p ON true
LIMIT %(outer)s
"""

# The claim's plan must be ordered index scans that stop at the limit. With its parameters
# unknown the planner misjudges the sizes and prefers a bitmap scan or another index plus a
# sort of the whole rest of a difference (tens of ms per lane with a backlog): the claim's
# connection turns those off (the scans it needs have no sort and no bitmap). And JIT: the
# penalty cost of the one small sort left (the running transactions' rows) would trigger
# JIT compilation, most of a second per claim. No parallel plan: _reads relies on each
# lane's rows coming together, part a before part b, as the nested loop and Append give them.
CLAIM_PLANNER = (
    "-c enable_sort=off -c enable_incremental_sort=off -c enable_bitmapscan=off -c jit=off "
    "-c max_parallel_workers_per_gather=0"
)

# Blocked keys (a refused message holds back the later ones of its key, in block mode) and
# rows an operator asked to retry, of the owned lanes: usually none, one index probe.
FAILURES = """
SELECT f.id, f.message_id, f.topic, f.key, f.message_type, f.payload, f.headers, f.created_at,
       f.run_id, f.lane, f.state, f.blocking
FROM {schema}.outbox_failures AS f
WHERE f.lane = ANY(CAST(:lanes AS int[])) AND (f.state <> 'failed' OR f.blocking)
ORDER BY f.lane, f.id
LIMIT :limit
"""

# One statement records a clean batch: the proof per lane, and the lanes' cursors, fenced.
RECORD = """
WITH v AS (
    SELECT * FROM unnest(CAST(:lanes AS int[]), CAST(:tokens AS bigint[]), CAST(:ids AS bigint[]),
                         CAST(:partitions AS int[]), CAST(:offsets AS bigint[]))
         AS v(lane, token, id, partition, kafka_offset)
),
proof AS (
    INSERT INTO {schema}.deliveries
        (lane, relay_id, token, first_id, last_id, ids, partitions, offsets)
    SELECT lane, :relay_id, token, min(id), max(id), array_agg(id ORDER BY id),
           array_agg(partition ORDER BY id), array_agg(kafka_offset ORDER BY id)
    FROM v WHERE id IS NOT NULL GROUP BY lane, token
    RETURNING lane
),
locked AS (  -- in lane order, as every statement writing several lanes (relay/lanes.py)
    SELECT lane FROM {schema}.relay_lanes
    WHERE lane = ANY(CAST(:c_lanes AS int[])) AND owner = :relay_id ORDER BY lane FOR UPDATE
),
moved AS (
    UPDATE {schema}.relay_lanes AS l
    SET cursor_snapshot = CAST(c.snap AS pg_snapshot),
        batch_snapshot = CAST(c.target AS pg_snapshot), batch_pos = c.pos,
        published_count = l.published_count + c.n, last_error = NULL, last_error_at = NULL
    FROM unnest(CAST(:c_lanes AS int[]), CAST(:c_tokens AS bigint[]), CAST(:c_snaps AS text[]),
                CAST(:c_targets AS text[]), CAST(:c_pos AS bigint[]), CAST(:c_n AS bigint[]))
         AS c(lane, token, snap, target, pos, n), locked AS k
    WHERE l.lane = c.lane AND k.lane = c.lane AND l.token = c.token AND l.owner = :relay_id
    RETURNING l.lane
)
SELECT (SELECT count(*) FROM proof) AS proofs, (SELECT array_agg(lane) FROM moved) AS moved,
       -- A clean batch's record need not wait for the WAL flush (see the daemon): said in the
       -- statement itself, so that it can run alone, as its own transaction.
       set_config('synchronous_commit', CASE WHEN :durable THEN 'on' ELSE 'off' END, true)
           AS synchronous_commit
"""

# A refused row is copied whole: retention may delete the outbox row long before an operator
# looks at it. A retried row refused again is updated in place.
RECORD_FAILURES = """
INSERT INTO {schema}.outbox_failures
    (id, message_id, topic, key, lane, message_type, payload, headers, run_id, created_at,
     state, blocking, error, dlq_partition, dlq_offset)
SELECT r.id, r.message_id, r.topic, r.key, r.lane, r.message_type, r.payload,
       CAST(r.headers AS jsonb), r.run_id, r.created_at, r.state, r.blocking, r.error,
       r.dlq_partition, r.dlq_offset
FROM unnest(CAST(:ids AS bigint[]), CAST(:message_ids AS uuid[]), CAST(:topics AS text[]),
            CAST(:keys AS bytea[]), CAST(:lanes AS int[]), CAST(:types AS text[]),
            CAST(:payloads AS bytea[]), CAST(:headers AS text[]), CAST(:run_ids AS uuid[]),
            CAST(:created AS timestamptz[]), CAST(:states AS text[]), CAST(:blocking AS bool[]),
            CAST(:errors AS text[]), CAST(:dlq_partitions AS int[]), CAST(:dlq_offsets AS bigint[]))
     AS r(id, message_id, topic, key, lane, message_type, payload, headers, run_id, created_at,
          state, blocking, error, dlq_partition, dlq_offset)
ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, blocking = EXCLUDED.blocking,
    error = coalesce(EXCLUDED.error, {schema}.outbox_failures.error), failed_at = now(),
    dlq_partition = EXCLUDED.dlq_partition, dlq_offset = EXCLUDED.dlq_offset
"""

# Retried rows that Kafka has now acknowledged leave the failures.
FORGET_FAILURES = "DELETE FROM {schema}.outbox_failures WHERE id = ANY(CAST(:ids AS bigint[]))"

NOTE_ERROR = """
WITH locked AS (  -- in lane order, as every statement writing several lanes (relay/lanes.py)
    SELECT lane FROM {schema}.relay_lanes
    WHERE lane = ANY(CAST(:lanes AS int[])) AND owner = :relay_id ORDER BY lane FOR UPDATE
)
UPDATE {schema}.relay_lanes AS l SET last_error = :error, last_error_at = now()
FROM locked WHERE l.lane = locked.lane AND l.owner = :relay_id
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
    run_id: uuid.UUID | None = None
    # From outbox_failures: an operator asked to publish it again ('retry').
    retry: bool = False


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


@dataclass(frozen=True)
class Claimed:
    """One claim: the rows in (lane order, id), what each lane read, and the failures' view."""

    rows: list[OutboxRow]
    reads: dict[int, LaneRead]
    # (lane, topic, key) → 'held' while a refused row blocks the key, 'retry' while an
    # operator's retry of it is under way: later rows of the key join the queue, unsent.
    blocked: dict[tuple[int, str, bytes | None], str]


def claim(
    conn: Connection,
    schema: str,
    *,
    relay_id: str,
    cursors: Mapping[int, Cursor | int],
    limit: int,
    rotate: int = 0,
) -> Claimed:
    """Up to *limit* rows of the owned lanes' differences, each lane's rows in id order.

    *cursors* maps each owned lane to the relay's cursor for it, or to the lane's token
    alone when the relay has none yet (the one in ``relay_lanes`` is then used). *rotate*
    shifts which lane is read first, so a busy lane cannot starve the others. Rows that an
    operator asked to retry come first, and rows of blocked keys are set aside (see
    :class:`Claimed`).
    """
    if not cursors:
        return Claimed([], {}, {})
    order = sorted(cursors)
    shift = rotate % len(order)
    order = order[shift:] + order[:shift]
    known = [cursors[lane] for lane in order]
    tokens = {
        lane: c.token if isinstance(c, Cursor) else c for lane, c in zip(order, known, strict=True)
    }
    params: dict[str, Any] = {
        "lanes": order,
        "tokens": [tokens[lane] for lane in order],
        "known": [isinstance(c, Cursor) for c in known],
        "snaps": [c.snapshot if isinstance(c, Cursor) else None for c in known],
        "targets": [c.target if isinstance(c, Cursor) else None for c in known],
        "pos": [c.pos if isinstance(c, Cursor) else 0 for c in known],
        "floors": [c.floor if isinstance(c, Cursor) else None for c in known],
        "ceils": [c.ceil if isinstance(c, Cursor) else None for c in known],
        "relay_id": relay_id,
        "more": limit + 1,
        # One more than a lane's part a can fill: the first lane always gets some of part b.
        "outer": limit + len(order) + 1,
    }
    # Executed through SQLAlchemy, so a database error is a SQLAlchemyError (the loop backs
    # off on those) and a dropped connection is invalidated; but the rows are read from the
    # driver's cursor as plain tuples: decoding a thousand Row objects cost a sixth of the
    # relay's loop.
    result = conn.exec_driver_sql(_claim_sql(schema), params)
    try:
        fetched = result.cursor.fetchall()
    finally:
        result.close()
    blocked: dict[tuple[int, str, bytes | None], str] = {}
    retried: list[OutboxRow] = []
    if fetched and fetched[0][18]:
        blocked, retried = _failures(conn, schema, order, limit)
    rows, reads = _reads(fetched, tokens, limit, limit + 1, cut=len(fetched) >= params["outer"])
    return Claimed(retried + rows, reads, blocked)


@functools.cache
def _claim_sql(schema: str) -> str:
    return CLAIM.replace("{schema}", f'"{schema}"')  # a validated identifier, see relay.sql


def _failures(
    conn: Connection, schema: str, lanes: list[int], limit: int
) -> tuple[dict[tuple[int, str, bytes | None], str], list[OutboxRow]]:
    blocked: dict[tuple[int, str, bytes | None], str] = {}
    retried: list[OutboxRow] = []
    for r in conn.execute(sql(FAILURES, schema), {"lanes": lanes, "limit": 10 * limit}):
        key = (r.lane, r.topic, bytes(r.key) if r.key is not None else None)
        if r.state == "retry":
            if blocked.get(key) != "held" and len(retried) < limit // 2 + 1:
                retried.append(
                    OutboxRow(
                        r.id,
                        r.message_id,
                        r.topic,
                        key[2],
                        r.message_type,
                        bytes(r.payload),
                        r.headers or {},
                        r.created_at,
                        r.lane,
                        r.run_id,
                        retry=True,
                    )
                )
            blocked.setdefault(key, "retry")
        else:  # a blocking refusal, or held behind one
            blocked[key] = "held"
    # A key whose retried rows are not all being sent now keeps the rest queued behind them.
    return blocked, retried


def _reads(
    fetched: Sequence[Any], tokens: Mapping[int, int], room: int, more: int, *, cut: bool = False
) -> tuple[list[OutboxRow], dict[int, LaneRead]]:
    """The rows taken (at most *room*) and, per lane, the cursor used and how far they go.

    Each lane's rows come in two parts (b: the id range, a: the running transactions' rows
    outside it), each in id order and counted (got, up to *more*). A part is complete when
    all of it came and it was not cut at *more*; a part cut short (by its limit, or by the
    claim's limit across lanes) is known only up to the last id that came, so the lane's rows
    are merged by id up to there. A lane is read to its end only when both parts were
    complete and every row was taken.

    *cut*: the claim's limit across lanes was reached, so the last lane that came may be cut.
    Its part a comes first: cut inside part b, that part's count tells (as above). But cut
    inside or right after part a, its part b is missing altogether, and a missing part looks
    like an empty one: the lane's rows would be taken as if there were no others, and its
    cursor would pass the rows of part b it never saw (lost). That lane is left unread.
    """
    heads: dict[int, Any] = {}
    parts: dict[int, dict[str, list[Any]]] = {}
    for r in fetched:
        heads.setdefault(r[1], r)
        if r[7] is not None:
            parts.setdefault(r[1], {}).setdefault(r[7], []).append(r)
    if cut and fetched and fetched[-1][7] == "a":
        heads.pop(fetched[-1][1], None)
        parts.pop(fetched[-1][1], None)
    rows: list[OutboxRow] = []
    reads: dict[int, LaneRead] = {}
    for lane, head in sorted(heads.items(), key=lambda item: item[1][0]):
        cursor = Cursor(tokens[lane], head[2], head[3], head[4], head[5], head[6])
        merged: list[Any] = []
        bound: float = float("inf")
        complete = True
        for part in parts.get(lane, {}).values():
            part.sort(key=lambda r: r[9])
            if len(part) < part[0][8] or part[0][8] >= more:
                complete = False
                bound = min(bound, part[-1][9])
            merged += part
        merged.sort(key=lambda r: r[9])
        taken = [r for r in merged if r[9] <= bound][: max(0, room - len(rows))]
        exhausted = complete and len(taken) == len(merged)
        rows += [
            OutboxRow(r[9], r[10], r[11], bytes(r[12]) if r[12] is not None else None, r[13],
                      bytes(r[14]), loads(r[15]) if r[15] else {}, r[16], lane, r[17])
            for r in taken
        ]
        reads[lane] = LaneRead(lane, cursor, tuple(r[9] for r in taken), exhausted)
    return rows, reads


def record(
    conn: Connection,
    schema: str,
    *,
    relay_id: str,
    published: list[Published],
    failed: list[Failed],
    set_aside: list[tuple[OutboxRow, str]],
    cursors: Mapping[int, tuple[Cursor, int]],
    blocking: bool,
    durable: bool = True,
) -> list[int]:
    """Record a batch's outcome and move the lanes' *cursors*; return the lanes moved.

    *published* rows get their proof in ``deliveries``; *failed* ones (permanent refusals)
    and *set_aside* ones (state 'held' or 'retry', with the reason) are copied to
    ``outbox_failures``; retried rows that went through leave it. *cursors* maps a lane to
    its new cursor and how many of its rows were published. A lane whose token moved on is
    not moved (it is another relay's now); its proof is still written, since it is true.
    With *blocking*, a refused row without a dead-letter copy blocks the later rows of its key.
    Without *durable*, the transaction's commit does not wait for the WAL flush.
    """
    lanes = sorted(cursors)
    row = conn.execute(
        sql(RECORD, schema),
        {
            "lanes": [p.row.lane for p in published],
            "tokens": [_token(cursors, p.row.lane) for p in published],
            "ids": [p.row.id for p in published],
            "partitions": [p.partition for p in published],
            "offsets": [p.offset for p in published],
            "relay_id": relay_id,
            "durable": durable,
            "c_lanes": lanes,
            "c_tokens": [cursors[lane][0].token for lane in lanes],
            "c_snaps": [cursors[lane][0].snapshot for lane in lanes],
            "c_targets": [cursors[lane][0].target for lane in lanes],
            "c_pos": [cursors[lane][0].pos for lane in lanes],
            "c_n": [cursors[lane][1] for lane in lanes],
        },
    ).one()
    retried = [p.row.id for p in published if p.row.retry]
    if retried:
        conn.execute(sql(FORGET_FAILURES, schema), {"ids": retried})
    entries: list[tuple[OutboxRow, str, str | None, int | None, int | None, bool]] = [
        (f.row, "failed", f.error, f.partition, f.offset, blocking and f.offset is None)
        for f in failed
    ]
    entries += [(r, state, None, None, None, False) for r, state in set_aside]
    if entries:
        _copy_failures(conn, schema, entries)
    return list(row.moved or [])


def _token(cursors: Mapping[int, tuple[Cursor, int]], lane: int) -> int:
    entry = cursors.get(lane)
    return entry[0].token if entry is not None else -1


def _copy_failures(conn: Connection, schema: str, entries: list[tuple[Any, ...]]) -> None:

    rows = [e[0] for e in entries]
    conn.execute(
        sql(RECORD_FAILURES, schema),
        {
            "ids": [r.id for r in rows],
            "message_ids": [r.message_id for r in rows],
            "topics": [r.topic for r in rows],
            "keys": [r.key for r in rows],
            "lanes": [r.lane for r in rows],
            "types": [r.message_type for r in rows],
            "payloads": [r.payload for r in rows],
            "headers": [dumps(r.headers) for r in rows],
            "run_ids": [r.run_id for r in rows],
            "created": [r.created_at for r in rows],
            "states": [e[1] for e in entries],
            "blocking": [e[5] for e in entries],
            "errors": [e[2][:2000] if e[2] else None for e in entries],
            "dlq_partitions": [e[3] for e in entries],
            "dlq_offsets": [e[4] for e in entries],
        },
    )


def note_error(
    conn: Connection, schema: str, *, relay_id: str, lanes: list[int], error: str
) -> None:
    """Say on the lanes why their rows wait (a transient failure): ``outbox status`` shows it."""
    conn.execute(
        sql(NOTE_ERROR, schema), {"lanes": lanes, "relay_id": relay_id, "error": error[:2000]}
    )
