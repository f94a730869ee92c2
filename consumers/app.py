"""The consumer application: which handler takes which topic.

::

    app = Consumer(group_id="orders")

    @app.handler("order.submit")
    def place(ctx: HandlerContext, order: OrderSubmit) -> None:
        ctx.conn.execute(...)            # commits with the dedup mark, or not at all

The payload type is the handler's annotation (:mod:`consumers.handlers`). Run the app with
``python -m consumers module:app`` (or ``outbox consume module:app``), or embed it with
``consumers.Runner(app).run()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from consumers.handlers import (
    BatchHandler,
    Handler,
    Registration,
    batch_registration,
    registration,
)
from consumers.settings import ConsumerSettings
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

H = TypeVar("H", bound=Handler)
B = TypeVar("B", bound=BatchHandler)


class Consumer:
    """A set of handlers consumed as one Kafka consumer group.

    It only describes: :class:`consumers.Runner` runs it (the runner imports this module,
    so this one does not import the runner).
    """

    def __init__(
        self,
        group_id: str,
        *,
        settings: ConsumerSettings | None = None,
        outbox_settings: OutboxSettings | None = None,
    ) -> None:
        self.settings = settings or ConsumerSettings()
        self.group_id = self.settings.group_id or group_id
        if not self.group_id:
            raise ConfigurationError("a consumer needs a group_id")
        self.outbox_settings = outbox_settings or OutboxSettings()
        self.registrations: dict[str, Registration] = {}

    @property
    def topics(self) -> list[str]:
        return sorted(self.registrations)

    def register(self, topic: str, handler: Handler) -> None:
        """Handle each message of *topic*; the payload type is the handler's second
        parameter's annotation (a pydantic model, ``bytes``, ``dict`` or none).

        Raises:
            ConfigurationError: the topic has a handler already, or the annotation is not
                one of those.
        """
        self._add(registration(topic, handler))

    def register_batch(self, topic: str, handler: BatchHandler) -> None:
        """Handle *topic*'s messages a poll batch at a time (one call, one statement).

        The handler takes one ``Sequence[tuple[HandlerContext, T]]``, T read as in
        :meth:`register`. For throughput: the handler writes the whole batch at once. When
        it raises, the batch is split in halves, each in its own savepoint, until the
        failing message is alone; it then takes the retry and dead-letter path like any
        other.
        """
        self._add(batch_registration(topic, handler))

    def handler(self, topic: str) -> Callable[[H], H]:
        """Decorator form of :meth:`register`."""

        def decorate(fn: H) -> H:
            self.register(topic, fn)
            return fn

        return decorate

    def batch_handler(self, topic: str) -> Callable[[B], B]:
        """Decorator form of :meth:`register_batch`."""

        def decorate(fn: B) -> B:
            self.register_batch(topic, fn)
            return fn

        return decorate

    def _add(self, registration: Registration) -> None:
        if registration.topic in self.registrations:
            raise ConfigurationError(f"topic {registration.topic!r} already has a handler")
        self.registrations[registration.topic] = registration
