"""What ``outbox status`` shows: the backlog and who publishes what.

Ages are computed with the database's clock (the one that wrote the timestamps), read when
the statement runs rather than when its transaction began, and never shown below zero. A
relay whose heartbeat is older than the lane lease is dead: its lanes are (or are about to
be) taken over, and the relays sweep its row away after a few leases.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Connection

from relay.sql import sql

# One pass over the outbox (a command run by hand, not a metric): each row is published when
# its lane's cursor passed it and it is not among the failures; refused rows are counted
# from outbox_failures (held and retried ones are still pending).
COUNTS = """
SELECT count(*) FILTER (WHERE (NOT s.passed AND s.state IS NULL)
                             OR s.state IN ('held', 'retry')) AS pending,
       (SELECT count(*) FROM {schema}.outbox_failures WHERE state = 'failed') AS failed,
       count(*) FILTER (WHERE s.passed AND s.state IS NULL) AS published,
       greatest(0, coalesce(extract(epoch FROM clock_timestamp() - min(s.created_at)
                                    FILTER (WHERE NOT s.passed AND s.state IS NULL)), 0))
           AS oldest_age
FROM (
    SELECT m.created_at, f.state,
           {schema}.outbox_passed(m.xid, m.id, l.cursor_snapshot, l.batch_snapshot,
                                  l.batch_pos) AS passed
    FROM {schema}.outbox_messages AS m
    LEFT JOIN {schema}.relay_lanes AS l ON l.lane = m.lane
    LEFT JOIN {schema}.outbox_failures AS f ON f.id = m.id
) AS s
"""

# now() would be when this transaction began: a heartbeat committed since then is "in the
# future" (a negative age). clock_timestamp() is read as the statement runs.
RELAYS = """
SELECT r.relay_id, r.idle,
       greatest(0, extract(epoch FROM clock_timestamp() - r.heartbeat_at)) AS heartbeat_age,
       coalesce(array_agg(l.lane ORDER BY l.lane) FILTER (WHERE l.lane IS NOT NULL), '{}')
           AS lanes
FROM {schema}.relays AS r
LEFT JOIN {schema}.relay_lanes AS l
  ON l.owner = r.relay_id AND l.expires_at > clock_timestamp()
GROUP BY r.relay_id, r.idle, r.heartbeat_at
ORDER BY r.relay_id
"""

UNOWNED = """
SELECT lane FROM {schema}.relay_lanes
WHERE owner IS NULL OR expires_at IS NULL OR expires_at <= clock_timestamp() ORDER BY lane
"""


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

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for relay, info in zip(data["relays"], self.relays, strict=True):
            relay["state"] = info.state
        return data


def read_status(conn: Connection, schema: str, *, lease_seconds: float) -> Status:
    """The outbox's counts and the relays, judging a relay dead after *lease_seconds* silent."""
    counts = conn.execute(sql(COUNTS, schema)).one()
    relays = [
        RelayInfo(r.relay_id, r.idle, float(r.heartbeat_age), list(r.lanes),
                  dead=float(r.heartbeat_age) > lease_seconds)
        for r in conn.execute(sql(RELAYS, schema))
    ]
    unowned = list(conn.execute(sql(UNOWNED, schema)).scalars())
    return Status(counts.pending, counts.failed, counts.published, float(counts.oldest_age),
                  relays, unowned)
