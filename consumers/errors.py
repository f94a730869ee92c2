"""Errors of the consumers package, in the :class:`outbox.errors.OutboxError` tree::

    OutboxError
    ├── ConfigurationError          (outbox) also: an unsafe dedup window, a bad app path
    └── ConsumerError               consumers errors
        ├── MalformedMessage        the record cannot be handled as it is: poison
        └── FailureNotFound         no failure has this id

Handler control flow (:mod:`consumers.control`) is not in this tree.
"""

from __future__ import annotations

from outbox.errors import OutboxError


class ConsumerError(OutboxError):
    """Base of the consumers' errors."""


class MalformedMessage(ConsumerError):
    """A record no handler can take (no message id, not JSON, wrong schema): dead-lettered."""

    def __init__(self, topic: str, partition: int, offset: int, reason: str) -> None:
        super().__init__(f"malformed message at {topic}[{partition}]@{offset}: {reason}")
        self.topic, self.partition, self.offset, self.reason = topic, partition, offset, reason


class NotDeadLettered(ConsumerError):
    """The failure is not dead-lettered (someone replayed or discarded it, or it recovered):
    nothing was done."""

    def __init__(self, failure_id: int, status: str, action: str = "replay") -> None:
        super().__init__(f"failure {failure_id} is {status!r}, not dead-lettered: nothing to "
                         f"{action}; nothing was changed")
        self.failure_id = failure_id
        self.status = status


class FailureNotFound(ConsumerError):
    """No row of the failures table has this id; list them with ``list_failures``."""

    def __init__(self, failure_id: int) -> None:
        super().__init__(f"no consumer failure with id {failure_id}: see list_failures()")
        self.failure_id = failure_id
