"""``outbox relay rebase``: make a restored or moved outbox this cluster's (relay/history.py).

After ``pg_dump``/``pg_restore`` or logical replication into another cluster, the outbox's
transaction ids and the lanes' cursors are the old cluster's. The rebase, one transaction,
with every relay stopped: rows the stored cursors passed and whose outcome is on record (the
broker's proof in ``deliveries``, or a copy in ``outbox_failures``) are marked seen (xid 2,
visible in every snapshot); every other row, among them every row written on this cluster
since the move, is given the rebase's own transaction id (pending: published once, in id
order per key, by the next relays); every cursor starts over, every lane's token moves on,
and ``relay_history`` names this cluster. The proof and the failures are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox.db.queries import sql
from outbox.errors import ConfigurationError

if TYPE_CHECKING:  # the commands' and the console's: the daemon runs without it
    from sqlalchemy import Connection


@dataclass(frozen=True)
class History:
    """What ``history_check`` found: nothing when the outbox is this server's."""

    cluster_moved: bool  # relay_history names another cluster
    cursors_ahead: list[int]
    rows_ahead: list[int]

    @property
    def moved(self) -> bool:
        return self.cluster_moved or bool(self.cursors_ahead or self.rows_ahead)

    def describe(self) -> str:
        """What was found, in one line."""
        signs = []
        if self.cluster_moved:
            signs.append("the outbox was written on another PostgreSQL cluster than this one")
        lanes = sorted(set(self.cursors_ahead) | set(self.rows_ahead))
        if lanes:
            signs.append(f"{len(lanes)} lanes carry transaction ids this server has not "
                         "issued yet")
        return "; ".join(signs)


@dataclass(frozen=True)
class Rebased:
    seen: int
    pending: int


def check_history(conn: Connection, schema: str) -> History:
    """Whether the outbox's transaction ids are this server's (see relay/history.py)."""
    row = conn.execute(sql("relay", "history_check", schema)).one()
    return History(bool(row.cluster_moved), list(row.cursors_ahead), list(row.rows_ahead))


def rebase(conn: Connection, schema: str) -> Rebased:
    """Rebase the outbox in the caller's transaction (it commits); refuses while relays run."""
    live = list(conn.execute(sql("relay", "rebase_live_lanes", schema)).scalar_one())
    if live:
        raise ConfigurationError(
            f"relays hold {len(live)} lanes: stop every relay first (a lane is free once its "
            "lease runs out), then run the rebase again"
        )
    row = conn.execute(sql("relay", "rebase_rows", schema)).one()
    conn.execute(sql("relay", "rebase_lanes", schema))
    conn.execute(sql("relay", "rebase_cluster", schema))
    conn.execute(sql("relay", "rebase_incarnation", schema))
    return Rebased(int(row.seen), int(row.pending))
