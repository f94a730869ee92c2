"""Whether the database's transaction ids are the history the relay's cursors were taken in.

A cursor (relay/cursors.py) is a snapshot of transaction ids, and those ids mean something
only in the history of the server that issued them. Three ways that history changes under a
running relay:

* **A crash-restart.** Crash recovery sets the next id from the WAL that reached disk: the
  ids of transactions whose WAL did not (a rolled-back transaction's abort, any commit with
  ``synchronous_commit = off``, the relay's own clean records among them) are handed out
  again. ``pg_postmaster_start_time()`` and the timeline stay as they were.
* **A promotion.** A promoted standby hands out again the ids of whatever its old primary did
  after the last record it received.
* **A move into another cluster** (``pg_dump``/``pg_restore``, logical replication).

The first two: a cursor the relay holds *in memory* from before can count a new transaction
that re-uses an id as seen. So the server has an *incarnation*, the one row of the UNLOGGED
table ``relay_server`` (migration 0010): crash recovery and a promotion empty it, nothing else
does, and the first claim that finds it empty writes a new one. The claim statement uses the
relay's cursors only when they were read under the incarnation it finds, else the cursors
stored in ``relay_lanes`` (safe: the record that stored one started after its snapshot and
survived, so every id the cursor counts as seen was issued before it); the record statement
moves no cursor of a batch read under another incarnation. Both checks are in the statements,
not in the connection, so a transaction-pooling proxy cannot fool them.

The third: rows and stored cursors keep the old cluster's ids while the new one issues its
own from its own counter. Rows emitted there can get ids below a restored cursor's xmin
(counted as seen: never published), and rows pending at the move keep ids above every new
snapshot (pending until the counter passes them). The signs: ``relay_history`` (a logged
row, so it moves with the data) names another cluster than ``pg_control_system()``'s
identifier (made by initdb, kept by streaming replication and base backups); or a stored
cursor counts ids the server has not issued yet (its xmax is above the current snapshot's),
which cannot happen within one history. The claim then returns nothing and the relay
refuses to run; ``outbox relay rebase`` (relay/rebase.py) makes the outbox this cluster's.
``pg_upgrade`` keeps the counter but makes a new cluster: the relays refuse until the
rebase there too, which then skips nothing and re-sends nothing that has its proof.
"""

from __future__ import annotations

from outbox.errors import ConfigurationError

REBASE_HINT = (
    "stop every relay, then run `outbox relay rebase` once (docs/operations.md, 'Moving the "
    "database to another cluster'), then start the relays"
)


class HistoryMoved(ConfigurationError):
    """The lanes' cursors count transaction ids this server never issued."""

    def __init__(self, lanes: list[int]) -> None:
        super().__init__(
            "the outbox's transaction ids are not this PostgreSQL server's: the database was "
            "restored or replicated from another cluster (relay_history names another "
            "cluster, or the lanes' cursors count ids this server has not issued yet; "
            f"{len(lanes)} lanes read). Publishing would skip messages; the relay refuses to "
            f"run. To go on: {REBASE_HINT}"
        )
        self.lanes = lanes
