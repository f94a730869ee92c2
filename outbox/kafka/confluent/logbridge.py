"""librdkafka's log lines to a Python logger, each repeated line at most once per window.

While a broker is down, a librdkafka consumer retries its connection about 20 times a
second (its group coordinator lookup cuts the reconnect backoff short), and each failed
attempt is an ERROR line: a 5-minute outage wrote some 6,000 identical lines per consumer.
A line identical to one logged less than ``window_s`` ago (apart from the elapsed times
librdkafka puts in it) is counted instead, and the next one logged after the window says
how many were left out. Different lines, brokers and clients are never merged.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

# "(after 0ms in state CONNECT)", "(after 1803ms in state UP)": the same event each time.
_ELAPSED = re.compile(r"\(after \d+ms in state [A-Z_]+\)")

WINDOW_S = 10.0
_MAX_KEYS = 1000  # forget old lines beyond this many (a bound, not a working size)


class RepeatsSkipped:
    """A ``logger`` for librdkafka (confluent-kafka calls ``log(level, fmt, *args)``)."""

    def __init__(
        self,
        logger: logging.Logger,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.window_s, self.clock = logger, window_s, clock
        self._last: dict[tuple[int, str], tuple[float, int]] = {}  # key: (logged at, skipped)
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        text = msg % args if args else msg
        key = (level, _ELAPSED.sub("", text))
        now = self.clock()
        with self._lock:
            # A line not seen yet counts as logged a whole window ago, nothing skipped since.
            logged_at, skipped = self._last.get(key, (now - self.window_s, 0))
            if now - logged_at < self.window_s:
                self._last[key] = (logged_at, skipped + 1)
                return
            if len(self._last) >= _MAX_KEYS:
                self._forget_older_than(now - self.window_s)
            self._last[key] = (now, 0)
        if skipped:
            self.logger.log(level, "%s (%d more like it in the last %.0f s)", text, skipped,
                            now - logged_at)
        else:
            self.logger.log(level, "%s", text)

    def _forget_older_than(self, horizon: float) -> None:
        for key in [k for k, (at, _) in self._last.items() if at < horizon]:
            del self._last[key]
        if len(self._last) >= _MAX_KEYS:
            self._last.clear()
