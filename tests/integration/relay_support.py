"""A relay without Kafka for the integration tests of the outbox log: the daemon's claim,
cursor and record code, with Kafka's answer taken as "acknowledged"."""

from __future__ import annotations

import uuid

from sqlalchemy import Connection, Engine

from outbox.db.pool import Pool
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from outbox.settings import OutboxSettings
from relay.claims import Claimed, OutboxRow, Published, claim_messages, record
from relay.cursors import Cursor
from relay.lanes import LaneManager

ONE_LANE = OutboxSettings(lanes=1)  # every row in lane 0: one cursor sees them all


class Reader:
    """A relay without Kafka: owns the lanes, reads differences, records them as published."""

    def __init__(self, engine: Engine, *, lanes: int = 1, limit: int = 1000,
                 relay_id: str = "reader") -> None:
        self.engine, self.limit, self.relay_id = engine, limit, relay_id
        self.pool = pool_of(engine)
        self.lanes = LaneManager(self.pool, schema="outboxkit", relay_id=relay_id, lanes=lanes,
                                 lease_seconds=30, host="test", pid=1)
        self.lanes.heartbeat()
        self.cursors: dict[int, Cursor] = {}
        self.incarnation: uuid.UUID | None = None
        self.claims = 0

    def known(self) -> dict[int, Cursor | int]:
        """What the daemon passes to a claim: its cursor of each owned lane, or the token."""
        return {
            lane: c if (c := self.cursors.get(lane)) is not None and c.token == token else token
            for lane, token in self.lanes.owned().items()
        }

    def claim(self, limit: int | None = None) -> Claimed:
        """One claim from where the reader stands, nothing recorded."""
        with self.pool.connection() as conn:  # autocommit, as the daemon's claims
            return claim_messages(conn, "outboxkit", relay_id=self.relay_id,
                                  cursors=self.known(), limit=limit or self.limit,
                                  incarnation=self.incarnation)

    def step(self) -> list[OutboxRow]:
        batch = self.claim()
        if batch.incarnation != self.incarnation:  # as the daemon does (relay/history.py)
            self.cursors.clear()
            self.incarnation = batch.incarnation
        self.claims += 1
        moves: dict[int, tuple[Cursor, int]] = {}
        for lane, read in batch.reads.items():
            new = read.advanced(read.ids[-1] if read.ids else None)
            self.cursors[lane] = new
            if read.ids:
                moves[lane] = (new, len(read.ids))
        published = [Published(r, 0, r.id) for r in batch.rows]
        with self.pool.begin() as conn:
            record(conn, "outboxkit", relay_id=self.relay_id, published=published, failed=[],
                   set_aside=[], cursors=moves, blocking=False,
                   incarnation=batch.incarnation, tokens=batch.tokens)
        return batch.rows

    def drain(self) -> list[OutboxRow]:
        out: list[OutboxRow] = []
        while rows := self.step():
            out += rows
        return out


def pool_of(engine: Engine) -> Pool:
    """The relay's own kind of pool (outbox.db.pool) on *engine*'s database. It keeps no
    idle connection: nothing is left open for a test to close."""
    return Pool(engine.url.render_as_string(hide_password=False), size=0)


def put(conn: Connection, key: str, i: int, settings: OutboxSettings = ONE_LANE) -> uuid.UUID:
    return emit(conn, Envelope(topic="t", type="t", key=key, payload={"i": i}),
                settings=settings)
