"""When the worker looks again: a NOTIFY on the runs channel, or the next due time it knows.

Idle, the worker waits for whichever comes first: a notification (a run started, woken,
confirmed, requeued; see :mod:`outbox.runs.wakeups`), the earliest time a run becomes due
(a ``not_before`` of a queued or waiting run, a lease that expires: one cheap query over
the partial indexes the claim uses), or the fallback poll. So a timer fires on time without
polling, and a missed notification (the LISTEN connection was down) costs at most
``poll_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import ColumnElement, Select, func, literal_column, select, union_all

from outbox.backoff import Backoff
from outbox.db.dsn import connect_args, libpq_url, redact
from outbox.db.queries import quote_identifier
from outbox.db.tables import agent_runs

log = logging.getLogger(__name__)

# The LISTEN connection's reconnect pauses: 0.2 s doubling up to 10 s, reset once connected.
RECONNECT = Backoff(base=0.2, cap=10.0)


class Listener:
    """LISTENs on *channel* and calls *poke* on every notification; reconnects by itself.

    Its loss is logged only while *database_up* says the rest of the worker reaches the
    database: during an outage the worker's own warning is the one line.
    """

    def __init__(self, url: str, channel: str, poke: Callable[[], None],
                 database_up: Callable[[], bool]) -> None:
        self._url = url
        self._channel = channel
        self._poke = poke
        self._database_up = database_up
        self.connected = asyncio.Event()

    async def run(self) -> None:
        """Listen until cancelled."""
        failures, warned = 0, False
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    libpq_url(self._url), autocommit=True, **connect_args(self._url)
                ) as conn:
                    # LISTEN takes no parameter: the channel is an identifier, quoted by the
                    # one rule (pg_notify's text argument names the same channel).
                    await conn.execute(f"LISTEN {quote_identifier(self._channel)}")
                    self.connected.set()
                    # Always look once: what committed while nobody listened notified nobody,
                    # and the loop declares itself idle (which makes commits NOTIFY) only
                    # while this listens, so a loop that went idle first must do it now.
                    self._poke()
                    if warned:
                        log.info("LISTEN on %s restored", self._channel,
                                 extra={"event": "worker.listen_restored"})
                    failures, warned = 0, False
                    async for _ in conn.notifies():
                        self._poke()
            except psycopg.Error as exc:
                self.connected.clear()
                failures += 1
                if failures == 1:
                    self._poke()  # the database may be down: let the worker look (and say so)
                if failures >= 3 and not warned and self._database_up():
                    # One line per loss (not per attempt), and only when LISTEN alone fails.
                    warned = True
                    log.warning("LISTEN on %s keeps failing (%s); reconnecting, waking by "
                                "due times and the fallback poll meanwhile", self._channel,
                                redact(_first_line(exc)), extra={"event": "worker.listen_lost"})
                await asyncio.sleep(RECONNECT.delay(failures))


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _state(name: str) -> ColumnElement[bool]:
    # A literal, not a parameter: the partial indexes are used only for a constant predicate.
    return agent_runs.c.state == literal_column(f"'{name}'")


def next_due_statement() -> Select[Any]:
    """Seconds until the earliest run becomes due (``None``: no timer pending)."""
    runs, now = agent_runs, func.now()
    live = runs.c.purged_at.is_(None)
    timers = union_all(
        select(func.min(runs.c.not_before).label("at"))
        .where(_state("queued"), runs.c.not_before > now, live),
        select(func.min(runs.c.not_before).label("at"))
        .where(_state("waiting"), runs.c.not_before > now, live),
        select(func.min(runs.c.lease_expires_at).label("at"))
        .where(_state("running"), runs.c.lease_expires_at > now, live),
    ).subquery("timers")
    return select(func.extract("epoch", func.min(timers.c.at) - now))


NEXT_DUE = next_due_statement()
