"""The consumer application: which handler takes which topic, with which payload model.

::

    app = Consumer(group_id="orders")

    @app.handler("order.submit", model=OrderSubmit)
    def place(ctx: HandlerContext, order: OrderSubmit) -> None:
        ctx.conn.execute(...)            # commits with the dedup mark, or not at all

Run it with ``python -m consumers module:app`` (or ``outbox consume module:app``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from consumers.context import HandlerContext
from consumers.settings import ConsumerSettings
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[HandlerContext, Any], None]
BatchHandler = Callable[[Sequence[tuple[HandlerContext, Any]]], None]


@dataclass(frozen=True)
class Registration:
    """One topic's handler: per message (``handler``) or per batch (``batch_handler``)."""

    topic: str
    model: type[BaseModel]
    handler: Handler | None = None
    batch_handler: BatchHandler | None = None


class Consumer:
    """A set of handlers consumed as one Kafka consumer group."""

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

    def register(
        self, topic: str, model: type[M], handler: Callable[[HandlerContext, M], None]
    ) -> None:
        """Handle each message of *topic*, its JSON payload validated into *model*."""
        self._add(Registration(topic, model, handler=handler))

    def register_batch(
        self,
        topic: str,
        model: type[M],
        handler: Callable[[Sequence[tuple[HandlerContext, M]]], None],
    ) -> None:
        """Handle *topic*'s messages a poll batch at a time (one call, one statement).

        For throughput: the handler writes the whole batch at once. When it raises, the
        batch is split in halves, each in its own savepoint, until the failing message is
        alone; it then takes the retry and dead-letter path like any other.
        """
        self._add(Registration(topic, model, batch_handler=handler))

    def handler(
        self, topic: str, *, model: type[M]
    ) -> Callable[[Callable[[HandlerContext, M], None]], Callable[[HandlerContext, M], None]]:
        """Decorator form of :meth:`register`."""

        def decorate(
            fn: Callable[[HandlerContext, M], None],
        ) -> Callable[[HandlerContext, M], None]:
            self.register(topic, model, fn)
            return fn

        return decorate

    def batch_handler(self, topic: str, *, model: type[M]) -> Callable[[Any], Any]:
        """Decorator form of :meth:`register_batch`."""

        def decorate(fn: Any) -> Any:
            self.register_batch(topic, model, fn)
            return fn

        return decorate

    def run(self) -> int:
        """Consume until :meth:`stop`; see :class:`consumers.runner.Runner`."""
        from consumers.runner import Runner  # noqa: PLC0415 - the runner imports this module

        self._runner = Runner(self)
        return self._runner.run()

    def stop(self) -> None:
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner.stop()

    def _add(self, registration: Registration) -> None:
        if registration.topic in self.registrations:
            raise ConfigurationError(f"topic {registration.topic!r} already has a handler")
        if not (isinstance(registration.model, type) and issubclass(registration.model, BaseModel)):
            raise ConfigurationError(f"model for {registration.topic!r} must be a pydantic model")
        self.registrations[registration.topic] = registration
