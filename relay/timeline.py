"""Which history of the database a connection reads and writes: its timeline.

A standby promoted after a failover starts a new timeline. Its past is the old primary's up
to the last record it had received; what the old primary did after that (commits, and the
transaction ids it handed out, for example to the relay's own records, which do not wait
for the standby) is not in it, and the promoted node hands those transaction ids out again.

A lane's cursor is a snapshot of transaction ids (relay/cursors.py). One taken on the old
primary can count as seen a new transaction on the promoted node that reuses an id below
its xmax: that transaction's messages would never be sent. So the relay remembers the
timeline its in-memory cursors were read on, drops them when a connection is on another
one (they are read again from ``relay_lanes``, which the promoted node holds consistently
with its own past: a cursor there was committed after every transaction it counts as seen),
and never records a batch read on one timeline through a connection on another.

The timeline is read once per connection, when it is made: a connection stays on one
server, and a server that takes writes (``target_session_attrs=read-write``) stays on one
timeline while it runs.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, event

# The current WAL file's name starts with the timeline, 8 hex digits (PostgreSQL 15 names it
# after the insertion timeline). Both functions are PUBLIC: the least-privileged relay role
# can call them. On a server still in recovery they raise: no timeline (None).
TIMELINE_SQL = "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)"
KEY = "outboxkit_timeline"


class TimelineChanged(Exception):
    """A batch read on one timeline would be recorded on another (after a failover)."""

    def __init__(self, read_on: int | None, now: int | None) -> None:
        super().__init__(
            f"the database is on timeline {now}, the batch was read on timeline {read_on} "
            "(a failover): it is not recorded, its rows are read again from the new primary "
            "and those it still holds are sent again (duplicates with the same message ids)"
        )
        self.read_on, self.now = read_on, now


def watch(engine: Engine) -> None:
    """Remember each new connection's timeline in its ``info``."""
    event.listen(engine, "connect", _remember)


def _remember(dbapi_connection: Any, record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(TIMELINE_SQL)
        record.info[KEY] = int(cursor.fetchone()[0], 16)
    except Exception:  # in recovery: it takes no writes, so nothing is recorded through it
        record.info[KEY] = None
    finally:
        cursor.close()
        if not dbapi_connection.autocommit:
            dbapi_connection.rollback()  # leave no transaction open behind the pool's back


def of(conn: Connection) -> int | None:
    """The timeline of *conn*'s server (None: unknown, or in recovery)."""
    value = conn.info.get(KEY)
    return value if isinstance(value, int) else None
