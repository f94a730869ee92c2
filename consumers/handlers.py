"""A topic's handler, and what its payload parameter's annotation asks the record to become.

The annotation is the one place the payload type is stated (as FastStream reads it)::

    def place(ctx: HandlerContext, order: OrderSubmit) -> None   # JSON validated into it
    def keep(ctx: HandlerContext, raw: bytes) -> None            # the record's value as is
    def log(ctx: HandlerContext, data: dict[str, Any]) -> None   # a JSON object as parsed
    def any_(ctx: HandlerContext, data: Any) -> None             # any JSON value as parsed
    def write(items: Sequence[tuple[HandlerContext, OrderSubmit]]) -> None   # a batch

String annotations (``from __future__ import annotations``) are resolved in the handler's
module; anything else is refused when the handler is registered, not at the first message.
"""

from __future__ import annotations

import collections.abc
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter
from pydantic_core import SchemaValidator

from consumers.context import HandlerContext
from outbox.errors import ConfigurationError

Handler = Callable[[HandlerContext, Any], None]
# Called with a list: a handler may take a Sequence or a list of these pairs.
BatchHandler = Callable[[list[tuple[HandlerContext, Any]]], None]

ACCEPTED = (
    "a pydantic BaseModel subclass (the JSON payload validated into it), bytes (the raw "
    "value), dict or dict[str, Any] (a JSON object as parsed), Any or no annotation (any "
    "JSON value as parsed)"
)


@dataclass(frozen=True)
class Payload:
    """How a record's value becomes the handler's payload argument.

    ``raw``: the value is passed as bytes, nothing parsed. Otherwise the value is JSON and
    ``validate_json`` (one pass over the bytes) or ``validate_python`` (over what
    ``json.loads`` made of them) turns it into the payload; ``name`` is what a payload that
    does not fit is said not to match.
    """

    name: str
    raw: bool
    validate_json: Callable[[bytes], Any]
    validate_python: Callable[[Any], Any]


@dataclass(frozen=True)
class Registration:
    """One topic's handler: per message (``handler``) or per batch (``batch_handler``)."""

    topic: str
    payload: Payload
    handler: Handler | None = None
    batch_handler: BatchHandler | None = None


def _as_is(data: Any) -> Any:
    return data


_RAW = Payload("bytes", True, bytes, bytes)
_ANY_JSON = Payload("JSON", False, TypeAdapter(Any).validate_json, _as_is)
_OBJECT = TypeAdapter(dict[str, Any])
_JSON_OBJECT = Payload("dict[str, Any]", False, _OBJECT.validate_json, _OBJECT.validate_python)
_SEQUENCES = (collections.abc.Sequence, list)


def registration(topic: str, handler: Handler) -> Registration:
    """*handler* for *topic*, its payload type read from its second parameter."""
    _, second = _parameters(handler, 2, "(ctx: HandlerContext, payload: <type>)")
    return Registration(topic, _payload(handler, second, second.annotation), handler=handler)


def batch_registration(topic: str, handler: BatchHandler) -> Registration:
    """*handler* for *topic*'s batches: its one parameter a ``Sequence`` (or ``list``) of
    ``tuple[HandlerContext, <type>]``; the payload type is the tuple's second item."""
    (items,) = _parameters(
        handler, 1, "(items: Sequence[tuple[HandlerContext, <type>]])"
    )
    annotation = _unannotated(items.annotation)
    element: Any = Any
    if (typing.get_origin(annotation) or annotation) in _SEQUENCES:
        element = next(iter(typing.get_args(annotation)), Any)
    elif annotation not in (inspect.Parameter.empty, Any):
        element = None  # not a sequence: refused below
    if element is Any:
        return Registration(topic, _ANY_JSON, batch_handler=handler)
    pair_args = typing.get_args(element)
    if typing.get_origin(element) is not tuple or len(pair_args) != 2:
        raise ConfigurationError(
            f"batch handler {_name(handler)}: parameter {items.name!r} is annotated "
            f"{_shown(items.annotation)}; annotate it Sequence[tuple[HandlerContext, T]] "
            f"(or list[...]), T being {ACCEPTED}"
        )
    return Registration(topic, _payload(handler, items, pair_args[1]), batch_handler=handler)


def _parameters(
    handler: Callable[..., Any], count: int, shape: str
) -> list[inspect.Parameter]:
    """The first *count* parameters of *handler*, with string annotations resolved; a
    handler that cannot be called with *count* positional arguments is refused."""
    try:
        signature = inspect.signature(handler, eval_str=True)
    except NameError as exc:
        raise ConfigurationError(
            f"handler {_name(handler)}: an annotation names something its module does not "
            f"define ({exc}); define the payload type at module level"
        ) from exc
    except (TypeError, ValueError) as exc:  # not callable, or a builtin without a signature
        raise ConfigurationError(
            f"handler {_name(handler)} has no signature to read ({exc}); register a function"
        ) from exc
    positional = [
        p for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    required_after = [p for p in positional[count:] if p.default is p.empty]
    if len(positional) < count or required_after:
        raise ConfigurationError(
            f"handler {_name(handler)} takes {signature}; a handler takes {shape}"
        )
    return positional[:count]


def payload_of(annotation: Any) -> Payload | None:
    """What a payload parameter annotated *annotation* is given; None if it cannot be."""
    kind = _unannotated(annotation)
    if kind is inspect.Parameter.empty or kind is Any:
        return _ANY_JSON
    if kind is bytes:
        return _RAW
    if kind is dict or (typing.get_origin(kind) is dict
                        and typing.get_args(kind) in ((str, Any), (Any, Any))):
        return _JSON_OBJECT
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return Payload(kind.__name__, False, _model_json(kind), kind.model_validate)
    return None


def _model_json(kind: type[BaseModel]) -> Callable[[bytes], Any]:
    """*kind*'s JSON validation: its validator's own when the model is complete (a third
    less per message than ``model_validate_json``'s Python wrapper around it, which
    otherwise builds the model first)."""
    validator = kind.__pydantic_validator__
    if kind.__pydantic_complete__ and isinstance(validator, SchemaValidator):
        return validator.validate_json
    return kind.model_validate_json


def _payload(handler: Callable[..., Any], parameter: inspect.Parameter, annotation: Any) -> Payload:
    payload = payload_of(annotation)
    if payload is None:
        raise ConfigurationError(
            f"handler {_name(handler)}: parameter {parameter.name!r} is annotated "
            f"{_shown(annotation)}; a payload parameter takes {ACCEPTED}"
        )
    return payload


def _unannotated(annotation: Any) -> Any:
    """``Annotated[T, ...]`` as T: the metadata is the user's, not ours."""
    while typing.get_origin(annotation) is Annotated:
        annotation = annotation.__origin__
    return annotation


def _shown(annotation: Any) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__qualname__
    return repr(annotation).replace("typing.", "")


def _name(handler: Callable[..., Any]) -> str:
    name = getattr(handler, "__qualname__", None) or repr(handler)
    module = getattr(handler, "__module__", None)
    return f"{module}.{name}" if module else name
