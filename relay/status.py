"""What ``outbox status`` shows: the backlog and who publishes what."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Connection

from relay.sql import sql

COUNTS = """
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'failed') AS failed,
       count(*) FILTER (WHERE status = 'published') AS published,
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)
           AS oldest_age
FROM {schema}.outbox_messages
"""

RELAYS = """
SELECT r.relay_id, r.idle, extract(epoch FROM now() - r.heartbeat_at) AS heartbeat_age,
       coalesce(array_agg(l.lane ORDER BY l.lane) FILTER (WHERE l.lane IS NOT NULL), '{}')
           AS lanes
FROM {schema}.relays AS r
LEFT JOIN {schema}.relay_lanes AS l ON l.owner = r.relay_id AND l.expires_at > now()
GROUP BY r.relay_id, r.idle, r.heartbeat_at
ORDER BY r.relay_id
"""

UNOWNED = """
SELECT lane FROM {schema}.relay_lanes
WHERE owner IS NULL OR expires_at IS NULL OR expires_at <= now() ORDER BY lane
"""


@dataclass(frozen=True)
class RelayInfo:
    relay_id: str
    idle: bool
    heartbeat_age_s: float
    lanes: list[int]


@dataclass(frozen=True)
class Status:
    pending: int
    failed: int
    published: int
    oldest_pending_age_s: float
    relays: list[RelayInfo] = field(default_factory=list)
    unowned_lanes: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_status(conn: Connection, schema: str) -> Status:
    counts = conn.execute(sql(COUNTS, schema)).one()
    relays = [RelayInfo(r.relay_id, r.idle, float(r.heartbeat_age), list(r.lanes))
              for r in conn.execute(sql(RELAYS, schema))]
    unowned = list(conn.execute(sql(UNOWNED, schema)).scalars())
    return Status(counts.pending, counts.failed, counts.published, float(counts.oldest_age),
                  relays, unowned)
