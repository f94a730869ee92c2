"""Effect tools: calling one asks for an outside effect through the outbox; nothing runs inline.

An effect tool is a plain function that turns the model's (validated) arguments into the
payload of one Kafka message. pydantic-ai sees an ordinary tool, with the schema and docstring
of that function; when the model calls it, the function builds the payload and the call is
*deferred* (pydantic-ai's ``CallDeferred``): the agent run stops with the call pending, and
:class:`outbox_agents.OutboxDurability` writes the message to the outbox, in the transaction that
moves the run to ``waiting``. When the run resumes, the call returns what the consumer side
confirmed, and that result is journaled like any tool's.

Arguments that do not validate never reach the function: pydantic-ai sends the model its
usual retry prompt, and nothing is written.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter
from pydantic_ai import CallDeferred
from pydantic_ai.toolsets import FunctionToolset

from outbox.errors import ConfigurationError
from outbox_agents import journal

F = TypeVar("F", bound=Callable[..., Any])
EFFECT = "outboxkit-effect"
"""The key of a deferred call's metadata that carries the effect's message."""

KeyFunc = Callable[[Any], str | bytes | None]
_JSON: TypeAdapter[Any] = TypeAdapter(Any)


@dataclass(frozen=True)
class EffectSpec:
    """Where an effect tool's messages go."""

    tool: str
    topic: str
    type: str
    key: KeyFunc | None


def payload_json(payload: Any) -> Any:
    """The payload as a JSON value (a pydantic model as ``model_dump(mode="json")``)."""
    if isinstance(payload, BaseModel):
        return payload.model_dump(mode="json")
    return _JSON.dump_python(payload, mode="json")


def message_key(spec: EffectSpec, payload: Any) -> str | None:
    """The Kafka key of *payload* (bytes keys are stored as text: they must be UTF-8)."""
    if spec.key is None:
        return None
    key = spec.key(payload)
    if isinstance(key, bytes):
        return key.decode()
    return key


class Effects(FunctionToolset[Any]):
    """A toolset of effect tools: give it to the agent (``Agent(..., toolsets=[effects],
    capabilities=[OutboxDurability()])``).

    ::

        effects = Effects()

        @effects.effect(topic="supplier.orders", key=lambda order: order.item)
        def reorder(item: str, qty: int) -> Reorder:
            \"\"\"Order *qty* more of *item* from the supplier.\"\"\"
            return Reorder(item=item, qty=qty)
    """

    def __init__(self, *, id: str = "outboxkit-effects") -> None:
        super().__init__(id=id)
        self.specs: dict[str, EffectSpec] = {}

    def effect(self, *, topic: str, type: str | None = None,
               key: KeyFunc | None = None, name: str | None = None,
               requires_approval: bool = False) -> Callable[[F], F]:
        """Register the decorated function as an effect tool.

        *topic* and *type* (default: the tool's name) go on the message; *key* maps the
        payload to its Kafka key (one key, one partition, in commit order). With
        *requires_approval* the call first waits for a person's approval of this tool with
        these exact arguments (:func:`outbox.grant`); the approval expires, and it is spent
        in the transaction that sends the message, so it sends one message at most.
        """
        if not topic:
            raise ConfigurationError("an effect tool needs a topic")

        def register(fn: F) -> F:
            if inspect.iscoroutinefunction(fn):
                raise ConfigurationError(
                    f"effect tool {fn.__name__!r} is async: it only builds the message "
                    "payload from its arguments, so make it a plain function")
            tool = name or fn.__name__
            if tool in self.specs:
                raise ConfigurationError(f"effect tool {tool!r} is registered twice")
            spec = EffectSpec(tool=tool, topic=topic, type=type or tool, key=key)

            signature = inspect.signature(fn)

            @functools.wraps(fn)
            async def defer(*args: Any, **kwargs: Any) -> Any:
                # Every argument, positional ones included: the approval's digest covers them.
                arguments = dict(signature.bind(*args, **kwargs).arguments)
                payload = fn(*args, **kwargs)
                # A run resumed after the confirmation: the call returns it.
                confirmed = journal.confirmed_result()
                if confirmed is not journal.MISSING:
                    return confirmed
                raise CallDeferred(metadata={EFFECT: {
                    "topic": spec.topic, "type": spec.type,
                    "key": message_key(spec, payload), "payload": payload_json(payload),
                    "args": payload_json(arguments), "approval": requires_approval,
                    "call": journal.current_call(),
                }})

            # Not pydantic-ai's requires_approval: an outboxkit approval is bound to the
            # exact arguments and spent with the message (see outbox_agents.runner).
            # The metadata is part of the pinned version: the approval flag changes what a run
            # does; the topic does not (it is often configuration, per environment).
            self.add_function(defer, takes_ctx=False, name=tool,
                              metadata={EFFECT: {"approval": requires_approval}})
            self.specs[tool] = spec
            return fn

        return register
