"""A test-only hook: SIGKILL this process after a database commit, before the offset commit.

Set ``OUTBOXKIT_CONSUMER_TEST_KILL_AFTER_COMMITS=N`` and the consumer kills itself right
after its N-th database commit, before it commits the Kafka offsets: the moment whose
redelivery the dedup marks must absorb. Unset (always, outside tests) it does nothing.
Formal failpoints replace it later (issue 6).
"""

from __future__ import annotations

import os
import signal

ENV = "OUTBOXKIT_CONSUMER_TEST_KILL_AFTER_COMMITS"


class KillAfterCommits:
    def __init__(self) -> None:
        raw = os.environ.get(ENV, "")
        self.remaining = int(raw) if raw.isdigit() and int(raw) > 0 else None

    def committed(self) -> None:
        if self.remaining is None:
            return
        self.remaining -= 1
        if self.remaining <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
