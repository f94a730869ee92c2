"""Exceptions a handler raises to steer its message: retry later, dead-letter, skip.

They are control flow, not errors, and deliberately live outside the :class:`OutboxError`
tree so that ``except OutboxError`` in a handler never swallows them.
"""

from __future__ import annotations


class HandlerControl(Exception):
    """Base of the control-flow exceptions a handler may raise."""


class RetryLater(HandlerControl):
    """Roll this message back and try it again after *delay_s* (counts as an attempt)."""

    def __init__(self, reason: str = "handler asked to retry later", delay_s: float | None = None):
        super().__init__(reason)
        self.reason, self.delay_s = reason, delay_s


class DeadLetter(HandlerControl):
    """Roll this message back and send it to the dead-letter topic now, without retrying."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SkipMessage(HandlerControl):
    """Roll the handler's writes back but count the message as handled (marked, not redone)."""

    def __init__(self, reason: str = "skipped by the handler") -> None:
        super().__init__(reason)
        self.reason = reason
