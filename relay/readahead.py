"""Reading the next batch while the current one is being sent.

A busy relay's cycle is claim, send and wait for the acknowledgements, record (the record on
a thread of its own). The claim's statement and the acknowledgements are waits on other
processes, so the relay reads batch N+1 on a thread while batch N is sent: from the cursors
batch N leaves when every row of it is acknowledged. Batch N+1 is still sent only after all
of batch N was acknowledged, so per-key order is the same as without reading ahead.

Reading has no effect, so a batch read ahead is simply dropped when it was read from
anything else than what is in force when it is wanted: other lanes or tokens, a cursor that
did not move as assumed (a row not acknowledged, a refusal, a record that failed, another
server incarnation). A batch with refused, set-aside or retried rows drops it explicitly:
the keys it blocks are decided from the failures recorded after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from relay.claims import Claimed
from relay.cursors import Cursor

log = logging.getLogger(__name__)

# What a claim reads from: each lane's cursor, or its token alone (relay.claims).
From = Mapping[int, Cursor | int]


@dataclass(frozen=True)
class _Ahead:
    lanes: Mapping[int, int]  # the lanes (and their tokens) it was read for
    source: From  # the cursors it was read from
    incarnation: object  # the server's incarnation they were read under
    batch: Future[Claimed]


class ReadAhead:
    """At most one batch read ahead, on a thread of its own."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-read")
        self._ahead: _Ahead | None = None

    def start(self, read: Callable[[From], Claimed], lanes: Mapping[int, int],
              source: From, incarnation: object) -> None:
        """Read the batch that follows *source* for *lanes*, in the background."""
        self.drop()
        self._ahead = _Ahead(dict(lanes), dict(source), incarnation,
                             self._pool.submit(read, source))

    def take(self, lanes: Mapping[int, int], source: From,
             incarnation: object) -> Claimed | None:
        """The batch read ahead if it was read for these *lanes* from this *source* under
        this *incarnation*; None otherwise (it is dropped). A read that failed is None too:
        the caller reads again."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        try:
            batch = ahead.batch.result()
        except Exception as exc:  # the loop's own claim meets it again, and reports it
            log.debug("reading ahead failed: %s", exc)
            return None
        if (dict(lanes) != ahead.lanes or dict(source) != ahead.source
                or incarnation != ahead.incarnation):
            return None
        return batch

    def drop(self) -> None:
        """Forget the batch read ahead (after its read ended: one claim at a time)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.batch.exception()  # waits; its error, if any, does not matter now

    def close(self) -> None:
        self.drop()
        self._pool.shutdown(wait=True)
