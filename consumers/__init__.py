"""outboxkit's idempotent Kafka consumers: at-least-once delivery, effects exactly once.

Register handlers on a :class:`Consumer`; run it with ``python -m consumers module:app``
(or ``outbox consume module:app``), or embed it with :class:`Runner`.
"""

from consumers.app import Consumer
from consumers.context import HandlerContext
from consumers.control import DeadLetter, HandlerControl, RetryLater, SkipMessage
from consumers.errors import ConsumerError, FailureNotFound, MalformedMessage
from consumers.handlers import Registration
from consumers.replay import rehandle, republish
from consumers.runner import Runner
from consumers.settings import ConsumerSettings

__all__ = [
    "Consumer",
    "ConsumerError",
    "ConsumerSettings",
    "DeadLetter",
    "FailureNotFound",
    "HandlerContext",
    "HandlerControl",
    "MalformedMessage",
    "Registration",
    "RetryLater",
    "Runner",
    "SkipMessage",
    "rehandle",
    "republish",
]
