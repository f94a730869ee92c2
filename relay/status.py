"""What ``outbox status`` shows: the backlog and who publishes what.

Ages are computed with the database's clock (the one that wrote the timestamps), read when
the statement runs rather than when its transaction began, and never shown below zero. A
relay whose heartbeat is older than the lane lease is dead: its lanes are (or are about to
be) taken over, and the relays sweep its row away after a few leases.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from outbox.db.queries import sql
from relay.rebase import check_history

if TYPE_CHECKING:  # the commands' and the console's: the daemon runs without it
    from sqlalchemy import Connection


@dataclass(frozen=True)
class RelayInfo:
    relay_id: str
    idle: bool
    heartbeat_age_s: float
    lanes: list[int]
    # Silent for longer than the lane lease: killed, or cut off from the database.
    dead: bool = False

    @property
    def state(self) -> str:
        return "dead" if self.dead else "idle" if self.idle else "busy"


@dataclass(frozen=True)
class Status:
    pending: int
    failed: int
    published: int
    oldest_pending_age_s: float
    relays: list[RelayInfo] = field(default_factory=list)
    unowned_lanes: list[int] = field(default_factory=list)
    # Why the outbox's transaction ids are not this server's, when they are not: the
    # database was restored or moved into another cluster (relay/history.py).
    history_moved: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for relay, info in zip(data["relays"], self.relays, strict=True):
            relay["state"] = info.state
        return data


def read_status(conn: Connection, schema: str, *, lease_seconds: float) -> Status:
    """The outbox's counts and the relays, judging a relay dead after *lease_seconds* silent."""
    counts = conn.execute(sql("relay", "status_counts", schema)).one()
    relays, unowned = read_relays(conn, schema, lease_seconds=lease_seconds)
    history = check_history(conn, schema)
    return Status(counts.pending, counts.failed, counts.published, float(counts.oldest_age),
                  relays, unowned, history.describe() if history.moved else None)


def read_relays(conn: Connection, schema: str, *,
                lease_seconds: float) -> tuple[list[RelayInfo], list[int]]:
    """The relays with their lanes, and the lanes nobody owns: two small reads (the console
    shows them live; :func:`read_status` adds the counts, a pass over the outbox)."""
    relays = [
        RelayInfo(r.relay_id, r.idle, float(r.heartbeat_age), list(r.lanes),
                  dead=float(r.heartbeat_age) > lease_seconds)
        for r in conn.execute(sql("relay", "status_relays", schema))
    ]
    return relays, list(conn.execute(sql("relay", "unowned_lanes", schema)).scalars())
