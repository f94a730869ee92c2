"""A handler's payload type is its annotation: each accepted kind, each refused one.

The annotations below are strings (``from __future__ import annotations``): reading them
resolves them in this module, as a user's handler module would be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any

import pytest
from pydantic import BaseModel

from consumers import Consumer, HandlerContext, MalformedMessage
from consumers.decode import decode
from outbox.errors import ConfigurationError
from tests.unit.test_consumer_decode import Record


class Order(BaseModel):
    item: str
    qty: int


@dataclasses.dataclass
class NotAModel:
    item: str


def takes_order(ctx: HandlerContext, order: Order) -> None: ...
def takes_bytes(ctx: HandlerContext, raw: bytes) -> None: ...
def takes_dict(ctx: HandlerContext, data: dict) -> None: ...  # type: ignore[type-arg]
def takes_str_any_dict(ctx: HandlerContext, data: dict[str, Any]) -> None: ...
def takes_any(ctx: HandlerContext, data: Any) -> None: ...
def takes_annotated(ctx: HandlerContext, order: Annotated[Order, "doc"]) -> None: ...
def takes_orders(items: Sequence[tuple[HandlerContext, Order]]) -> None: ...
def takes_order_list(items: list[tuple[HandlerContext, Order]]) -> None: ...
def takes_raw_batch(items: Sequence[tuple[HandlerContext, bytes]]) -> None: ...
def takes_int(ctx: HandlerContext, n: int) -> None: ...
def takes_dataclass(ctx: HandlerContext, order: NotAModel) -> None: ...
def takes_only_ctx(ctx: HandlerContext) -> None: ...
def takes_int_dict(ctx: HandlerContext, data: dict[str, int]) -> None: ...
def takes_ints(items: Sequence[int]) -> None: ...
def takes_two(items: Sequence[tuple[HandlerContext, Order]], more: int) -> None: ...
def takes_set(items: set[tuple[HandlerContext, Order]]) -> None: ...


def payload_for(handler: Any, *, batch: bool = False) -> Any:
    """What *handler* would be given for this order's record."""
    app = Consumer("g")
    (app.register_batch if batch else app.register)("orders", handler)
    return decode(Record(b'{"item": "bolt", "qty": 2}'), app.registrations["orders"]).payload


def refusal(handler: Any, *, batch: bool = False) -> str:
    app = Consumer("g")
    with pytest.raises(ConfigurationError) as caught:
        (app.register_batch if batch else app.register)("orders", handler)
    assert not app.registrations
    return str(caught.value)


class TestAccepted:
    def test_a_model_gets_the_json_validated_into_it(self) -> None:
        assert payload_for(takes_order) == Order(item="bolt", qty=2)

    def test_annotated_metadata_is_looked_through(self) -> None:
        assert payload_for(takes_annotated) == Order(item="bolt", qty=2)

    def test_bytes_gets_the_value_as_sent(self) -> None:
        assert payload_for(takes_bytes) == b'{"item": "bolt", "qty": 2}'

    @pytest.mark.parametrize("handler", [takes_dict, takes_str_any_dict, takes_any])
    def test_dict_and_any_get_the_json_as_parsed(self, handler: Any) -> None:
        assert payload_for(handler) == {"item": "bolt", "qty": 2}

    def test_no_annotation_gets_the_json_as_parsed(self) -> None:
        assert payload_for(lambda ctx, data: None) == {"item": "bolt", "qty": 2}

    @pytest.mark.parametrize("handler", [takes_orders, takes_order_list])
    def test_a_batch_handler_s_model_is_its_sequence_s_second_item(self, handler: Any) -> None:
        assert payload_for(handler, batch=True) == Order(item="bolt", qty=2)

    def test_a_batch_handler_of_bytes_or_without_annotation(self) -> None:
        assert payload_for(takes_raw_batch, batch=True) == b'{"item": "bolt", "qty": 2}'
        assert payload_for(lambda items: None, batch=True) == {"item": "bolt", "qty": 2}

    def test_the_decorator_registers_and_returns_the_handler(self) -> None:
        app = Consumer("g")
        assert app.handler("orders")(takes_order) is takes_order
        assert app.batch_handler("more")(takes_orders) is takes_orders
        assert app.topics == ["more", "orders"]


class TestDecodingByKind:
    def test_bytes_takes_a_value_that_is_not_json(self) -> None:
        app = Consumer("g")
        app.register("orders", takes_bytes)
        assert decode(Record(b"\xff\x00 not json"), app.registrations["orders"]).payload == (
            b"\xff\x00 not json")

    @pytest.mark.parametrize("handler", [takes_dict, takes_any, lambda ctx, data: None])
    def test_a_json_handler_refuses_what_is_not_json_as_a_model_would(self, handler: Any) -> None:
        app = Consumer("g")
        app.register("orders", handler)
        with pytest.raises(MalformedMessage, match="not JSON"):
            decode(Record(b"{not json"), app.registrations["orders"])
        with pytest.raises(MalformedMessage, match="duplicate key 'a'"):
            decode(Record(b'{"a": 1, "a": 2}'), app.registrations["orders"])

    def test_a_dict_handler_refuses_json_that_is_not_an_object(self) -> None:
        app = Consumer("g")
        app.register("orders", takes_dict)
        with pytest.raises(MalformedMessage, match=r"does not match dict\[str, Any\]"):
            decode(Record(b"[1, 2]"), app.registrations["orders"])

    def test_an_any_handler_takes_any_json_value(self) -> None:
        app = Consumer("g")
        app.register("orders", takes_any)
        assert decode(Record(b"[1, 2]"), app.registrations["orders"]).payload == [1, 2]


class TestRefused:
    @pytest.mark.parametrize(
        ("handler", "parameter", "shown"),
        [(takes_int, "n", "int"), (takes_dataclass, "order", "NotAModel"),
         (takes_int_dict, "data", "dict[str, int]")],
    )
    def test_another_type_is_refused_naming_handler_parameter_and_what_is_accepted(
        self, handler: Any, parameter: str, shown: str
    ) -> None:
        message = refusal(handler)
        assert f"handler {__name__}.{handler.__qualname__}:" in message
        assert f"parameter {parameter!r} is annotated {shown};" in message
        assert "pydantic BaseModel subclass" in message
        assert "bytes (the raw value)" in message

    def test_a_handler_without_a_payload_parameter_is_refused(self) -> None:
        message = refusal(takes_only_ctx)
        assert "takes_only_ctx" in message
        assert "takes (ctx: HandlerContext, payload: <type>)" in message

    @pytest.mark.parametrize("handler", [takes_ints, takes_set, takes_order])
    def test_a_batch_handler_not_of_context_payload_pairs_is_refused(self, handler: Any) -> None:
        message = refusal(handler, batch=True)
        assert handler.__qualname__ in message
        assert "Sequence[tuple[HandlerContext, T]]" in message or "takes (items:" in message

    def test_a_batch_handler_with_a_second_required_parameter_is_refused(self) -> None:
        assert "takes (items: Sequence[tuple[HandlerContext, <type>]])" in refusal(
            takes_two, batch=True)

    def test_a_model_only_the_handler_s_function_can_see_is_refused_with_what_to_do(
        self,
    ) -> None:
        class Local(BaseModel):
            n: int

        def takes_local(ctx: HandlerContext, item: Local) -> None: ...

        message = refusal(takes_local)
        assert "takes_local" in message
        assert "'Local' is not defined" in message
        assert "define the payload type at module level" in message

    def test_something_without_a_signature_is_refused(self) -> None:
        assert "has no signature to read" in refusal(42)

    def test_a_second_handler_for_a_topic_is_refused(self) -> None:
        app = Consumer("g")
        app.register("orders", takes_order)
        with pytest.raises(ConfigurationError, match="already has a handler"):
            app.register("orders", takes_any)
