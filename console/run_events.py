"""A run's events as server-sent events (``GET /runs/{id}/events``): the library's follower
(:func:`outbox.runs.events.follow_run_events`), served.

Each event goes out with ``id:`` its number, ``event:`` its kind and ``data:`` its JSON; a
browser that loses the stream reconnects by itself and sends ``Last-Event-ID``, and the
stream goes on after that number: nothing missed, nothing twice (the numbers are in commit
order). When the run is finished and every event was sent, an ``end`` event (no id) closes
the stream; asked again then, the answer is 204, which tells a browser not to reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import Connection, Engine

from console.actions import BadInput
from outbox.db.execution import run_plan
from outbox.runs.events import DEFAULT_POLL, RunEvent, follow_run_events, page_plan
from outbox.runs.states import FINISHED, RunState
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)
# A comment line this often keeps a quiet stream open through proxies that drop idle ones.
KEEPALIVE_SECONDS = 15.0
# Each open stream reads every DEFAULT_POLL seconds on the console's pool: a bound on them.
MAX_STREAMS = 100
# And a bound per user, so that one viewer's tabs cannot take every stream.
MAX_STREAMS_PER_USER = 10


def position(last_event_id: str | None, after: str | None) -> int:
    """Where a stream resumes: ``Last-Event-ID`` (a browser's reconnection) wins over the
    ``after`` query parameter, which the first connection's URL keeps."""
    raw = last_event_id if last_event_id not in (None, "") else after
    if raw in (None, ""):
        return 0
    assert raw is not None
    if not raw.isdigit() or len(raw) > 18:
        raise BadInput(f"{raw[:30]!r} is not an event number (a whole number >= 0)")
    return int(raw)


def read_page(conn: Connection, run_id: uuid.UUID, after: int, limit: int,
              settings: OutboxSettings) -> tuple[RunState, list[RunEvent]]:
    """The run's state and its events after *after* (:class:`RunNotFound` if none)."""
    return run_plan(conn, page_plan(run_id, after=after, limit=limit), settings)


def page_json(run_id: uuid.UUID, state: RunState, events: list[RunEvent],
              after: int) -> dict[str, Any]:
    """The JSON answer: the events, the number to ask after next, and whether more can come
    (``finished``: the run is done or failed and these were all its events)."""
    return {"run_id": str(run_id), "state": state.value,
            "events": [e.as_dict() for e in events],
            "last": events[-1].seq if events else after,
            "finished": state in FINISHED}


def sse(event: RunEvent) -> str:
    data = json.dumps(event.as_dict(), default=str, separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {data}\n\n"


class RunStreams:
    """The open streams of run events: bounded, and ended together when the server stops."""

    def __init__(self, engine: Engine, settings: OutboxSettings,
                 poll: float = DEFAULT_POLL) -> None:
        self._engine, self._settings, self._poll = engine, settings, poll
        self._stopping = asyncio.Event()
        self.open = 0
        self._by_user: dict[str, int] = {}

    def refused(self, user: str) -> str | None:
        """Why another stream for *user* is refused now, or None."""
        if self.open >= MAX_STREAMS:
            return "too many run event streams are open"
        if self._by_user.get(user, 0) >= MAX_STREAMS_PER_USER:
            return f"{user} has {MAX_STREAMS_PER_USER} run event streams open already"
        return None

    def end_streams(self) -> None:
        """End every stream (the server is stopping; browsers reconnect to the next one,
        from their last event). Call it on the event loop's thread."""
        self._stopping.set()

    async def stream(self, run_id: uuid.UUID, after: int, *,
                     user: str = "") -> AsyncIterator[str]:
        """The events after *after* as server-sent events, each as it commits, then ``end``
        once the run is finished; a comment every KEEPALIVE_SECONDS while nothing happens."""
        self.open += 1
        self._by_user[user] = self._by_user.get(user, 0) + 1
        events = follow_run_events(self._engine, run_id, after=after, poll=self._poll,
                                   settings=self._settings)
        stopping = asyncio.ensure_future(self._stopping.wait())
        step: asyncio.Future[RunEvent] | None = None
        try:
            while not stopping.done():
                if step is None:
                    step = asyncio.ensure_future(anext(events))
                waits: set[asyncio.Future[Any]] = {step, stopping}
                done, _ = await asyncio.wait(waits, timeout=KEEPALIVE_SECONDS,
                                             return_when=asyncio.FIRST_COMPLETED)
                if step not in done:
                    if not done:
                        yield ": still following\n\n"
                    continue
                try:
                    event = step.result()
                except StopAsyncIteration:
                    yield "event: end\ndata: {}\n\n"
                    return
                except Exception as exc:  # the database went away: the browser reconnects
                    log.warning("console: following run %s failed: %s", run_id, exc,
                                extra={"event": "console.run_events_failed"})
                    return
                step = None
                yield sse(event)
        finally:
            self.open -= 1
            self._by_user[user] -= 1
            if not self._by_user[user]:
                del self._by_user[user]
            stopping.cancel()
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await step
            await events.aclose()
