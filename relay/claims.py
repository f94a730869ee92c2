"""Reading the next rows of owned lanes from the outbox log, and recording what Kafka said.

The relay never updates or deletes an outbox row: it reads snapshot differences (see
relay/cursors.py) and, once Kafka acknowledged a batch, writes one ``deliveries`` row per
lane (the ids with their partitions and offsets) and moves the lanes' cursors, in one
statement, fenced by the lanes' tokens. Refused rows are copied to ``outbox_failures``.
The statements are relay/queries.sql's (``claim_messages`` explains the claim's two parts).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from json import dumps, loads
from typing import Any, NamedTuple

from psycopg.rows import tuple_row

from outbox.db.arrays import bool_array, int_array, text_array
from outbox.db.locks import FAILURES_LOCK
from outbox.db.pool import Connection
from outbox.db.queries import driver_sql
from outbox.messages.envelope import HEADER_MESSAGE_ID, HEADER_TYPE
from relay.cursors import Cursor, LaneRead
from relay.history import HistoryMoved

# Headers the relay sets from the row's columns, whatever the envelope's JSON says.
OWN_HEADERS = frozenset((HEADER_MESSAGE_ID, HEADER_TYPE))

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


class OutboxRow:
    """One outbox row as the relay sends it.

    A claim makes a thousand of these per batch, so the relay's hot path keeps what it reads
    as the database shaped it: the message id as text (its header), the creation time as
    seconds (the latency metric), the headers as their JSON text, parsed once into the Kafka
    headers (:attr:`record_headers`). The typed views (``message_id``, ``headers``,
    ``created_at``) are made on demand, for the rare paths (refusals, dead letters, traces).
    ``run_id`` is known for retried rows only: a claim does not read it (no record needs it),
    and the copy of a refused row looks it up.
    """

    __slots__ = (
        "_created",
        "_headers",
        "_message_id",
        "_record_headers",
        "id",
        "key",
        "lane",
        "message_type",
        "payload",
        "retry",
        "run_id",
        "topic",
    )

    def __init__(self, id: int, message_id: uuid.UUID | str, topic: str,  # noqa: PLR0917
                 key: bytes | None, message_type: str, payload: bytes,
                 headers: Mapping[str, Any] | str | None, created_at: datetime | float,
                 lane: int, run_id: uuid.UUID | None = None, retry: bool = False) -> None:
        self.id, self._message_id, self.topic, self.key = id, message_id, topic, key
        self.message_type, self.payload, self._headers = message_type, payload, headers
        self._created, self.lane, self.run_id, self.retry = created_at, lane, run_id, retry
        self._record_headers: list[tuple[str, bytes]] | None = None

    @property
    def message_id(self) -> uuid.UUID:
        mid = self._message_id
        return mid if isinstance(mid, uuid.UUID) else uuid.UUID(mid)

    @property
    def headers(self) -> dict[str, Any]:
        """The envelope's headers (a new dict: the row's own stay as stored)."""
        raw = self._headers
        if raw is None:
            return {}
        return loads(raw) if isinstance(raw, str) else dict(raw)

    @property
    def created_at(self) -> datetime:
        created = self._created
        return created if isinstance(created, datetime) else datetime.fromtimestamp(created, UTC)

    @property
    def created_s(self) -> float:
        """When it was created, in seconds since the epoch."""
        created = self._created
        return created.timestamp() if isinstance(created, datetime) else created

    @property
    def record_headers(self) -> list[tuple[str, bytes]]:
        """The Kafka record's headers: the message id and type from their columns, then the
        envelope's other headers (built once per row)."""
        if self._record_headers is None:
            raw = self._headers
            found = (loads(raw) if isinstance(raw, str) else raw) or {}
            self._record_headers = [
                (HEADER_MESSAGE_ID, str(self._message_id).encode()),
                (HEADER_TYPE, self.message_type.encode()),
                *[(name, (value if isinstance(value, str) else str(value)).encode())
                  for name, value in found.items()
                  if value is not None and name not in OWN_HEADERS],
            ]
        return self._record_headers

    @property
    def lane_key(self) -> tuple[int, str, bytes | None]:
        """What order is kept within: (lane, topic, key)."""
        return (self.lane, self.topic, self.key)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OutboxRow):
            return NotImplemented
        return (self.id, self.retry, self.lane) == (other.id, other.retry, other.lane)

    def __hash__(self) -> int:
        return hash((self.id, self.retry, self.lane))

    def __repr__(self) -> str:
        return (f"OutboxRow(id={self.id}, topic={self.topic!r}, key={self.key!r}, "
                f"lane={self.lane}{', retry' if self.retry else ''})")


class Published(NamedTuple):
    """A row Kafka acknowledged, with where it landed (a tuple: one per message sent)."""

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
    # The server's incarnation the rows were read under (relay/history.py), and the
    # token of each lane claimed: the record is fenced by both.
    incarnation: uuid.UUID | None = None
    tokens: dict[int, int] = field(default_factory=dict)


def claim_messages(
    conn: Connection,
    schema: str,
    *,
    relay_id: str,
    cursors: Mapping[int, Cursor | int],
    limit: int,
    rotate: int = 0,
    incarnation: uuid.UUID | None = None,
) -> Claimed:
    """Up to *limit* rows of the owned lanes' differences, each lane's rows in id order.

    *cursors* maps each owned lane to the relay's cursor for it, or to the lane's token
    alone when the relay has none yet (the one in ``relay_lanes`` is then used). The relay's
    cursors are used only when *incarnation* is the server's (relay/history.py): read
    under another, they may count re-issued transaction ids as seen, and the stored ones are
    used instead. *rotate* shifts which lane is read first, so a busy lane cannot starve the
    others. Rows that an operator asked to retry come first, and rows of blocked keys are set
    aside (see :class:`Claimed`). Raises :class:`~relay.history.HistoryMoved` when a cursor
    counts transaction ids this server never issued (a restore into another cluster).
    """
    if not cursors:
        return Claimed([], {}, {}, incarnation)
    order = sorted(cursors)
    shift = rotate % len(order)
    order = order[shift:] + order[:shift]
    known = [cursors[lane] for lane in order]
    tokens = {
        lane: c.token if isinstance(c, Cursor) else c for lane, c in zip(order, known, strict=True)
    }
    # Arrays as literals: psycopg dumps a list element by element in Python.
    params: dict[str, Any] = {
        "lanes": int_array(order),
        "tokens": int_array([tokens[lane] for lane in order]),
        "known": bool_array([isinstance(c, Cursor) for c in known]),
        "snaps": text_array([c.snapshot if isinstance(c, Cursor) else None for c in known]),
        "targets": text_array([c.target if isinstance(c, Cursor) else None for c in known]),
        "pos": int_array([c.pos if isinstance(c, Cursor) else 0 for c in known]),
        "floors": int_array([c.floor if isinstance(c, Cursor) else None for c in known]),
        "ceils": int_array([c.ceil if isinstance(c, Cursor) else None for c in known]),
        "relay_id": relay_id,
        "incarnation": incarnation,
        "more": limit + 1,
        # Every lane yields at least one row (an empty one when it has none): the first lane
        # can always bring all of its limit + 1.
        "outer": limit + len(order) + 1,
    }
    fetched = _fetch(conn, schema, params)
    if fetched and fetched[0][7] is None:
        # No incarnation yet (crash recovery or a promotion emptied the table): the stored
        # cursors were used, which is right; make one and read again under it.
        conn.execute(driver_sql("relay", "ensure_incarnation", schema))
        fetched = _fetch(conn, schema, params)
    if not fetched:
        return Claimed([], {}, {}, incarnation, tokens)
    current = fetched[0][7]
    behind = sorted({r[1] for r in fetched if r[8]})  # lane rows only: messages have NULL
    if behind:
        raise HistoryMoved(behind)
    rows, reads = _reads(fetched, tokens, limit, limit + 1, cut=len(fetched) >= params["outer"])
    blocked: dict[tuple[int, str, bytes | None], str] = {}
    if fetched[0][9]:
        retried = _retries(conn, schema, order, limit // 2 + 1)
        blocked = _blocked(conn, schema, [r.lane_key for r in retried + rows])
        rows = retried + rows
    return Claimed(rows, reads, blocked, current, tokens)


def _fetch(conn: Connection, schema: str, params: dict[str, Any]) -> Sequence[Any]:
    # Rows as plain tuples: a thousand named ones would cost the loop more than the rest of
    # the read. In binary: PostgreSQL sends the payloads and keys as they are stored, not
    # hex-encoded for psycopg to decode again.
    with conn.cursor(row_factory=tuple_row) as cursor:
        cursor.execute(driver_sql("relay", "claim_messages", schema), params, binary=True)
        return cursor.fetchall()


def _retries(conn: Connection, schema: str, lanes: list[int], limit: int) -> list[OutboxRow]:
    """Rows an operator asked to retry, each after every row of its key still held back."""
    query = driver_sql("relay", "claim_retries", schema)
    return [
        OutboxRow(r.id, r.message_id, r.topic, _key(r.key), r.message_type, bytes(r.payload),
                  r.headers or {}, r.created_at, r.lane, r.run_id, retry=True)
        for r in conn.execute(query, {"lanes": lanes, "limit": limit})
    ]


def _blocked(
    conn: Connection, schema: str, keys: list[tuple[int, str, bytes | None]]
) -> dict[tuple[int, str, bytes | None], str]:
    """Which of *keys* outbox_failures holds back, and how: decided for these keys alone."""
    distinct = sorted(set(keys), key=repr)
    if not distinct:
        return {}
    found = conn.execute(
        driver_sql("relay", "blocked_keys", schema),
        {
            "lanes": [k[0] for k in distinct],
            "topics": [k[1] for k in distinct],
            "keys": [k[2] for k in distinct],
        },
    )
    return {(r.lane, r.topic, _key(r.key)): r.state for r in found}


def _key(value: Any) -> bytes | None:
    """A key as the driver returns it (bytes, memoryview, or None for a keyless row)."""
    return bytes(value) if value is not None else None


def _reads(
    fetched: Sequence[Any], tokens: Mapping[int, int], room: int, more: int, *, cut: bool = False
) -> tuple[list[OutboxRow], dict[int, LaneRead]]:
    """The rows taken (at most *room*) and, per lane, the cursor used and how far they go.

    *fetched* holds the lanes' own rows first (their cursors, id NULL), then their messages,
    lane after lane in the same order. Each lane's rows are the smallest ids of its
    difference, in id order (the statement merges its two parts), at most *more*. A lane is
    read to its end when fewer than *more* came, it was not cut by the claim's limit across
    lanes (*cut*: the last lane that came may be), and every row was taken. Otherwise the
    rows taken are a prefix, and the cursor remembers the last id done.
    """
    heads: dict[int, Any] = {}
    found: dict[int, list[Any]] = {}
    for r in fetched:
        if r[10] is None:  # a lane's own row: its cursor (they come first)
            heads[r[1]] = r
        else:
            rows_of = found.get(r[1])
            if rows_of is None:
                rows_of = found[r[1]] = []
            rows_of.append(r)
    last = fetched[-1][1] if cut and fetched else None
    # The lanes' rows come in the order their messages are read (the same scan of the same
    # lanes): the lanes after the cut one were not reached. Their rows are unread, but their
    # target and its id range (lo, hi) hold: kept in the cursor, the next claim does not
    # compute the range again (a scan of the lane's (lane, xid) index each time: with a
    # backlog over many lanes, most of PostgreSQL's work per claim).
    unreached: set[int] = set()
    if last is not None:
        order = list(heads)
        unreached = set(order[order.index(last) + 1:])
    rows: list[OutboxRow] = []
    reads: dict[int, LaneRead] = {}
    for lane, head in sorted(heads.items(), key=lambda item: item[1][0]):
        cursor = Cursor(tokens[lane], head[2], head[3], head[4], head[5], head[6])
        if lane in unreached:
            reads[lane] = LaneRead(lane, cursor, (), exhausted=False)
            continue
        merged = found.get(lane, [])
        complete = len(merged) < more and lane != last
        taken = merged[: max(0, room - len(rows))]
        exhausted = complete and len(taken) == len(merged)
        # (id, topic, key, payload, headers' JSON, type, message id, created); the run id is
        # not read (record_failures looks it up for the rows that fail)
        rows += [
            OutboxRow(r[10], r[16], r[11], r[12], r[15], r[13], r[14], r[17], lane)
            for r in taken
        ]
        reads[lane] = LaneRead(lane, cursor, tuple(r[10] for r in taken), exhausted)
    return rows, reads


def record(
    conn: Connection,
    schema: str,
    *,
    relay_id: str,
    published: list[Published],
    failed: list[Failed],
    set_aside: list[OutboxRow],
    cursors: Mapping[int, tuple[Cursor, int]],
    blocking: bool,
    incarnation: uuid.UUID | None,
    tokens: Mapping[int, int] | None = None,
    durable: bool = True,
) -> list[int]:
    """Record a batch's outcome and move the lanes' *cursors*; return the lanes moved.

    *published* rows get their proof in ``deliveries``; *failed* ones (permanent refusals)
    and *set_aside* ones (rows of a key held back when claimed: 'held' or 'retry', decided
    here from the key's failure rows as they are now) are copied to ``outbox_failures``;
    retried rows that went through leave it. *cursors* maps a lane to its new cursor and how
    many of its rows were published. Cursors move and failures are copied only for lanes
    whose token is still this relay's (*tokens*: the claim's, for lanes without a cursor
    move) and only while the server is the *incarnation* the batch was read under; the
    proof is written in any case, since it is true. With *blocking*, a refused row without a
    dead-letter copy blocks the later rows of its key. Without *durable*, the transaction's
    commit does not wait for the WAL flush.
    """
    lanes = sorted(cursors)
    retried = [p.row.id for p in published if p.row.retry]
    # Keyless rows have no order to keep: a refusal of one never holds anything back.
    entries: list[tuple[OutboxRow, str, str | None, int | None, int | None, bool]] = [
        (f.row, "failed", f.error, f.partition, f.offset,
         blocking and f.offset is None and f.row.key is not None)
        for f in failed
    ]
    entries += [(r, "aside", None, None, None, False) for r in set_aside]
    if entries or retried:
        # First, before any lane row is locked: an operator's retry takes this lock first too.
        conn.execute(driver_sql("relay", "lock_failures", schema), {"k": FAILURES_LOCK})
    with conn.cursor(row_factory=tuple_row) as cursor:
        cursor.execute(driver_sql("relay", "record_batch", schema), {
            **_proofs(published, cursors),
            "relay_id": relay_id,
            "incarnation": incarnation,
            "durable": durable,
            "c_lanes": int_array(lanes),
            "c_tokens": int_array([cursors[lane][0].token for lane in lanes]),
            "c_snaps": text_array([cursors[lane][0].snapshot for lane in lanes]),
            "c_targets": text_array([cursors[lane][0].target for lane in lanes]),
            "c_pos": int_array([cursors[lane][0].pos for lane in lanes]),
            "c_n": int_array([cursors[lane][1] for lane in lanes]),
        })
        row = cursor.fetchone()
    assert row is not None  # the statement's one row
    if retried:
        conn.execute(driver_sql("relay", "forget_failures", schema), {"ids": retried})
    if entries:
        known = {**(tokens or {}), **{lane: c.token for lane, (c, _) in cursors.items()}}
        _copy_failures(
            conn, schema, entries, relay_id=relay_id, incarnation=incarnation, tokens=known
        )
    return list(row[1] or [])  # (proofs, moved lanes, synchronous_commit)


def _proofs(
    published: Sequence[Published], cursors: Mapping[int, tuple[Cursor, int]]
) -> dict[str, str]:
    """The ``deliveries`` rows of a batch, as record_batch takes them: one per lane, its ids in
    order with their partitions and offsets, each list an array literal."""
    lanes: dict[int, list[Published]] = {}
    for p in published:
        of_lane = lanes.get(p.row.lane)
        if of_lane is None:
            of_lane = lanes[p.row.lane] = []
        of_lane.append(p)
    firsts: list[int] = []
    lasts: list[int] = []
    ids: list[str] = []
    partitions: list[str] = []
    offsets: list[str] = []
    for of_lane in lanes.values():
        lane_ids = [p.row.id for p in of_lane]
        in_order = sorted(lane_ids)
        if in_order != lane_ids:  # retried rows come first, whatever their ids
            of_lane.sort(key=lambda p: p.row.id)
            lane_ids = in_order
        firsts.append(lane_ids[0])
        lasts.append(lane_ids[-1])
        ids.append(int_array(lane_ids))
        partitions.append(int_array([p.partition for p in of_lane]))
        offsets.append(int_array([p.offset for p in of_lane]))
    return {
        "lanes": int_array(list(lanes)),
        "tokens": int_array([_token(cursors, lane) for lane in lanes]),
        "first_ids": int_array(firsts),
        "last_ids": int_array(lasts),
        # Literals of literals: each lane's array literal an element of a text[].
        "ids": text_array(ids),
        "partitions": text_array(partitions),
        "offsets": text_array(offsets),
    }


def _token(cursors: Mapping[int, tuple[Cursor, int]], lane: int) -> int:
    entry = cursors.get(lane)
    return entry[0].token if entry is not None else -1


def _copy_failures(
    conn: Connection,
    schema: str,
    entries: list[tuple[Any, ...]],
    *,
    relay_id: str,
    incarnation: uuid.UUID | None,
    tokens: Mapping[int, int],
) -> None:
    rows = [e[0] for e in entries]
    conn.execute(
        driver_sql("relay", "record_failures", schema),
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
            "tokens": [tokens.get(r.lane, -1) for r in rows],
            "relay_id": relay_id,
            "incarnation": incarnation,
        },
    )


def note_error(
    conn: Connection, schema: str, *, relay_id: str, lanes: list[int], error: str
) -> None:
    """Say on the lanes why their rows wait (a transient failure): ``outbox status`` shows it."""
    conn.execute(
        driver_sql("relay", "note_error", schema),
        {"lanes": lanes, "relay_id": relay_id, "error": error[:2000]},
    )
