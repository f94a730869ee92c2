"""Lane ownership: how several relays share the outbox without breaking per-key order.

Rows are hashed by key into a fixed number of lanes when they are emitted, so every message
of one key is in one lane. Each lane is owned by at most one relay at a time through a
lease row in ``relay_lanes``; acquiring a lane bumps its fencing token, and a relay claims
rows only for lanes whose (owner, token) still match and whose lease has not run out — in
the same SQL statement as the claim. A relay takes its fair share (lanes / live relays),
gives back the excess when others join (between batches, never with a batch in flight),
and a dead relay's lanes move to the others once its lease expires: a relay is counted
live exactly while its lanes' leases run (both are written by one heartbeat transaction),
and each heartbeat reports when another relay's lanes will run out before the next
renewal, so the daemon looks again at that moment instead of up to a heartbeat later.
Within a lane the
owner publishes in id order, and ids of one key are in commit order (emit serialises them),
so per-key order holds across relays, restarts and rebalances.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from outbox.db.pool import Pool, scalar
from outbox.db.queries import driver_sql

log = logging.getLogger(__name__)

# A dead relay stays listed (as dead, in ``outbox status``) this many leases, then goes.
FORGET_AFTER_LEASES = 6


@dataclass(frozen=True)
class OwnedLanes:
    """A snapshot of lanes and their fencing tokens, trusted only until *valid_until*."""

    tokens: dict[int, int]
    valid_until: float  # time.monotonic()
    # What the heartbeat that took the snapshot learned besides: the lanes it newly acquired
    # (the loop should claim them now) and, when another relay's lanes run out before they
    # could be renewed, in how many seconds (the moment to look again and take them).
    acquired: frozenset[int] = frozenset()
    others_expire_in: float | None = None

    def usable(self) -> dict[int, int]:
        return self.tokens if time.monotonic() < self.valid_until else {}


class LaneManager:
    """Owns this relay's lanes; ``heartbeat`` runs on a scheduler thread, the rest in the loop."""

    def __init__(
        self,
        pool: Pool,
        *,
        schema: str,
        relay_id: str,
        lanes: int,
        lease_seconds: float,
        host: str,
        pid: int,
    ) -> None:
        self._pool = pool
        self._schema = schema
        self.relay_id = relay_id
        self.lanes = lanes
        self.lease = lease_seconds
        self._host, self._pid = host, pid
        self._lock = threading.Lock()
        self._owned = OwnedLanes({}, 0.0)
        self._to_release: set[int] = set()
        self.live_relays = 1
        # A heartbeat and ``leave`` never overlap, and none runs after ``leave``: a heartbeat
        # still in its transaction when the relay left would register it again and take
        # lanes back, which the other relays could then not use until the lease expired.
        self._beat = threading.Lock()
        self._left = False

    def heartbeat(self) -> OwnedLanes:
        """Renew, then rebalance toward a fair share. Safe to call from any thread."""
        with self._beat:
            if self._left:
                return OwnedLanes({}, 0.0)
            return self._heartbeat()

    def _sql(self, name: str) -> str:
        return driver_sql("relay", name, self._schema)

    def _heartbeat(self) -> OwnedLanes:
        started = time.monotonic()
        params = {"relay_id": self.relay_id, "lease": self.lease, "lanes": self.lanes}
        with self._pool.begin() as conn:
            conn.execute(self._sql("ensure_lanes"), params)
            live = scalar(
                conn, self._sql("upsert_relay"), {**params, "host": self._host, "pid": self._pid}
            )
            tokens = {r.lane: r.token for r in conn.execute(self._sql("renew_lanes"), params)}
            fair = math.ceil(self.lanes / max(1, int(live)))
            acquired: set[int] = set()
            if len(tokens) < fair:
                rows = conn.execute(
                    self._sql("acquire_lanes"), {**params, "wanted": fair - len(tokens)}
                )
                for row in rows:
                    tokens[row.lane] = row.token
                    acquired.add(row.lane)
            expire_in = scalar(conn, self._sql("others_expire"), params)
        # Counted from after the commit (not from the database's now(), which was earlier), so
        # a look-again scheduled with it comes after the expiry, never before.
        others = None
        if expire_in is not None and float(expire_in) < self.lease * 2 / 3:
            others = float(expire_in)
        # Our clock started before the database's now(): a conservative deadline, with a
        # margin so a batch never runs up to the very end of the lease.
        valid_until = started + self.lease * 2 / 3
        excess = sorted(tokens)[fair:] if len(tokens) > fair else []
        with self._lock:
            self._owned = OwnedLanes(tokens, valid_until, frozenset(acquired), others)
            self._to_release = set(excess)
            self.live_relays = int(live)
        if excess:
            log.info(
                "relay %s gives back %d lanes (%d live relays)",
                self.relay_id,
                len(excess),
                live,
                extra={"event": "relay.lanes_rebalance"},
            )
        return self._owned

    def owned(self) -> dict[int, int]:
        """Lanes this relay may publish now, minus those it is about to give back."""
        with self._lock:
            usable = self._owned.usable()
            return {lane: tok for lane, tok in usable.items() if lane not in self._to_release}

    def releasing(self) -> bool:
        """Whether lanes are marked to be given back."""
        with self._lock:
            return bool(self._to_release)

    def release_pending(self) -> None:
        """Give back the lanes marked excess; call only between batches."""
        with self._lock:
            lanes = sorted(self._to_release)
            self._to_release = set()
            if not lanes:
                return
            self._owned = OwnedLanes(
                {k: v for k, v in self._owned.tokens.items() if k not in lanes},
                self._owned.valid_until,
            )
        with self._pool.begin() as conn:
            conn.execute(self._sql("release_lanes"), {"relay_id": self.relay_id, "lanes": lanes})

    def leave(self) -> None:
        """Give back every lane and drop out of the relays table (graceful shutdown)."""
        # A heartbeat stuck on the database must not hold the shutdown past one lease.
        beating = self._beat.acquire(timeout=self.lease)
        try:
            self._left = True
            with self._lock:
                lanes = list(range(self.lanes))
                self._owned = OwnedLanes({}, 0.0)
                self._to_release = set()
            with self._pool.begin() as conn:
                conn.execute(
                    self._sql("release_lanes"), {"relay_id": self.relay_id, "lanes": lanes}
                )
                conn.execute(self._sql("leave"), {"relay_id": self.relay_id})
        finally:
            if beating:
                self._beat.release()

    def forget_dead_relays(self) -> int:
        """Remove relays rows silent for several leases (their lanes moved on long before)."""
        with self._pool.begin() as conn:
            result = conn.execute(
                self._sql("forget_dead_relays"), {"horizon": self.lease * FORGET_AFTER_LEASES}
            )
        if result.rowcount:
            log.info(
                "forgot %d dead relays (silent for %d leases)",
                result.rowcount,
                FORGET_AFTER_LEASES,
                extra={"event": "relay.forget_dead"},
            )
        return int(result.rowcount)
