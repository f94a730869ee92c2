"""The overview's live counts: one reader for every open page.

Each open overview page holds a server-sent-events stream. Their counts come from one task
that reads the overview every ``refresh_seconds`` while at least one page listens, and none
while nobody does: twenty open pages cost the database what one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

log = logging.getLogger(__name__)


class Live:
    """Fans the latest overview out to every listener; reads only while someone listens."""

    def __init__(self, read: Callable[[], Any], every: float) -> None:
        self._read = read  # blocking: run in a thread
        self._every = every
        self._listeners = 0
        self._latest: tuple[int, str] | None = None
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._ending = False
        self._n = 0
        self._waking: asyncio.Task[None] | None = None
        self.reads = 0
        """How many times the overview was read (the cost stays one reader's)."""

    async def _poll(self) -> None:
        while self._listeners > 0:
            try:
                data = json.dumps(await asyncio.to_thread(self._read), default=str)
                self.reads += 1
            except Exception as exc:  # the database went away: say so, keep trying
                log.warning("console: reading the overview failed: %s", exc,
                            extra={"event": "console.overview_failed"})
                data = json.dumps({"error": "the database did not answer; retrying"})
            self._n += 1  # on the instance: ids keep growing across idle spells
            async with self._changed:
                self._latest = (self._n, data)
                self._changed.notify_all()
            await asyncio.sleep(self._every)
        self._task = None
        self._latest = None  # stale once nobody listens: the next page waits for a new read

    def _newer(self, seen: int) -> Callable[[], bool]:
        return lambda: self._ending or (self._latest is not None and self._latest[0] != seen)

    def end_streams(self) -> None:
        """End every stream (the server is stopping: a page's stream never ends by itself,
        and the server waits for its requests). Call it on the event loop's thread."""
        self._ending = True

        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        self._waking = asyncio.get_running_loop().create_task(wake())  # kept: not collected

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: the latest overview now, then each new one."""
        self._listeners += 1
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="console-live")
        seen = 0
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(self._newer(seen))
                    if self._ending:
                        return
                    assert self._latest is not None
                    seen, data = self._latest
                yield f"id: {seen}\nevent: overview\ndata: {data}\n\n"
        finally:
            self._listeners = max(self._listeners - 1, 0)

    async def close(self) -> None:
        self._listeners = 0
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
