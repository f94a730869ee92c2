"""Where each lane's reading stands: the relay's cursors over the outbox log (pure logic).

A lane's cursor is a PostgreSQL snapshot (``pg_snapshot``, as text): every row of the lane
whose writing transaction is visible in it has been published (or refused and recorded).
The next rows to publish are the *difference* between a later snapshot, the target, and the
cursor: rows whose transaction is visible in the target and not in the cursor, taken in id
order. That set is fixed once the target is chosen, so a difference larger than a batch is
published in steps, remembering the last id done (``pos``). When it is exhausted the target
becomes the cursor. This is PgQ's batch, per lane.

Why nothing is skipped: visibility in a snapshot is decided by transaction ids, not row ids,
so a transaction that commits late with a lower row id than rows already published was in
the cursor's list of running transactions and is visible in the next target: it belongs to
the next difference whatever its id. Nothing is inferred from the largest id seen, and
nothing waits for the oldest running transaction.

Why one key stays in order: emit takes a lock on (topic, key) before it draws the row's id
and holds it until commit, so of two messages of one key the second transaction draws its id
after the first committed. A snapshot that sees the second therefore sees the first: the
first is in the same difference (where id order puts it before) or an earlier one.

The database holds each lane's cursor (``relay_lanes``); the relay keeps a copy that runs one
batch ahead of it while the previous batch's evidence is being written. A lane whose token
changed (it was taken over, and maybe given back) is read from the database again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Cursor:
    """One lane's reading position; snapshots are ``pg_snapshot`` text (``xmin:xmax:xip``)."""

    token: int
    snapshot: str
    # The difference being published in steps: its target snapshot and the last id done.
    target: str | None = None
    pos: int = 0
    # The id range of the difference's rows written after the cursor's snapshot (as opposed
    # to those of transactions running at that moment), once computed for this target:
    # the read scans ids from floor to ceil instead of the whole lane.
    floor: int | None = None
    ceil: int | None = None

    def after(self, last_id: int | None, *, exhausted: bool) -> Cursor:
        """The cursor once the rows up to *last_id* of the current difference are done.

        *exhausted*: nothing of the difference is left, so the target becomes the cursor.
        """
        if exhausted:
            if self.target is None:
                return self
            return Cursor(self.token, self.target)
        if last_id is None:
            return self
        return replace(self, pos=max(self.pos, last_id))


@dataclass(frozen=True)
class LaneRead:
    """What one claim found for one lane: the cursor it used and how far the rows go."""

    lane: int
    cursor: Cursor  # with the target the claim chose and the floor/ceil it computed
    ids: tuple[int, ...]  # the rows taken, in id order
    exhausted: bool  # these rows are the rest of the difference

    def advanced(self, done: int | None) -> Cursor:
        """The cursor after the rows of this read up to id *done* were published or recorded.

        *done* is None when none were; the difference is exhausted only when all were.
        """
        if done is None:
            return self.cursor.after(None, exhausted=self.exhausted and not self.ids)
        all_done = not self.ids or done >= self.ids[-1]
        return self.cursor.after(done, exhausted=self.exhausted and all_done)
