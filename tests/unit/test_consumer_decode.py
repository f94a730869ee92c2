"""Consumer decoding is strict: UTF-8 JSON, each key once, or a MalformedMessage saying why.

Issue #13: UTF-16/UTF-32 JSON and duplicate keys were accepted although the contract is
UTF-8 JSON, and a value that was not UTF-8 was reported as a "utf-16-le decode error".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, RootModel, field_validator

from consumers import decode as decode_module
from consumers.decode import decode
from consumers.errors import MalformedMessage
from consumers.handlers import Payload, Registration, payload_of


class Line(BaseModel):
    sku: str
    qty: int


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")

    order_id: str
    customer: str
    lines: list[Line]
    notes: str = ""
    placed_at: str = ""
    tags: dict[str, int] = {}


class Loose(BaseModel):
    """Unknown fields ignored (pydantic's default): a repeated one is not even kept."""

    n: int


class Anything(BaseModel):
    data: Any


@dataclass
class Record:
    value: bytes | None
    topic: str = "orders"
    partition: int = 0
    offset: int = 7
    key: bytes | None = b"k"
    headers: list[tuple[str, bytes]] = field(default_factory=lambda: [("message-id", b"m-1")])


ORDER = {
    "order_id": "ord-0001-2345",
    "customer": "supplier-acme-812",
    "lines": [{"sku": "widget-blue", "qty": 3}, {"sku": "bolt-m6", "qty": 40}],
    "notes": "deliver to the back door before 12:00, see https://example.com/a:b",
    "placed_at": "2024-05-01T10:15:00+02:00",
    "tags": {"urgent": 1, "fragile": 0},
}
"""A typical ~270-byte order, with ':' in its strings (a time, a URL)."""


def decoded(value: bytes, model: type[BaseModel] = Order) -> BaseModel:
    payload = decode(Record(value), Registration("orders", _payload(model))).payload
    assert isinstance(payload, model)
    return payload


def refused(value: bytes, model: type[BaseModel] = Order) -> str:
    with pytest.raises(MalformedMessage) as caught:
        decode(Record(value), Registration("orders", _payload(model)))
    return caught.value.reason


def _payload(model: type[BaseModel]) -> Payload:
    payload = payload_of(model)
    assert payload is not None
    return payload


class TestOnlyUtf8:
    @pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32",
                                          "utf-32-le", "utf-32-be"])
    def test_json_in_another_unicode_encoding_is_not_utf8_json(self, encoding: str) -> None:
        reason = refused(json.dumps(ORDER).encode(encoding))
        assert reason.startswith("the payload is not UTF-8 JSON: it has a NUL byte at offset")

    def test_bytes_that_are_not_utf8_are_named(self) -> None:
        reason = refused(b'{"order_id": "\xff\xfe", "customer": "c", "lines": []}')
        assert reason == "the payload is not UTF-8 JSON: byte 0xff at offset 14 is not UTF-8"

    def test_a_nul_byte_is_not_guessed_to_be_utf16(self) -> None:
        # json.loads guessed the encoding from the first bytes: a NUL second byte made it
        # "utf-16-le", and the error a "'utf-16-le' codec can't decode" one.
        reason = refused(b"{\x00\xff\xdc")
        assert reason == (
            "the payload is not UTF-8 JSON: it has a NUL byte at offset 1 (UTF-16 or UTF-32?)"
        )

    def test_an_encoded_lone_surrogate_is_not_utf8(self) -> None:
        reason = refused('{"data": "\ud800"}'.encode("utf-8", "surrogatepass"), Anything)
        assert "not UTF-8 JSON: byte 0xed at offset 10" in reason

    def test_a_utf8_byte_order_mark_is_refused(self) -> None:
        # Decided (issue #13): RFC 8259 forbids senders to add one; refused, so that every
        # reader and every replay sees the same bytes the same way.
        reason = refused(b"\xef\xbb\xbf" + json.dumps(ORDER).encode())
        assert reason == (
            "the payload is not UTF-8 JSON: it starts with a byte order mark (EF BB BF); "
            "send it without"
        )

    def test_an_escaped_lone_surrogate_is_still_utf8_json(self) -> None:
        """``\\ud800`` is valid JSON text in UTF-8: what it decodes to is the model's business."""
        assert decoded(b'{"data": "x\\ud800y"}', Anything) == Anything(data="x\ud800y")

    def test_text_that_is_not_json_still_says_so(self) -> None:
        assert refused(b"not json").startswith("the payload is not JSON: Expecting value")


class TestEachKeyOnce:
    @pytest.mark.parametrize(
        ("value", "key"),
        [
            (b'{"order_id": "a", "order_id": "b", "customer": "c", "lines": []}', "order_id"),
            (b'{"order_id":"a","customer":"c","lines":[{"sku":"s","qty":1,"qty":2}]}', "qty"),
            (b'{"order_id":"a","customer":"c","lines":[],"tags":{"x":1,"x":1}}', "x"),
            # with ':' in strings the cheap count cannot decide: the exact check does
            (b'{"order_id":"12:00","customer":"c","customer":"d","lines":[]}', "customer"),
            # an escaped ':' (\u003a) counts like one
            (b'{"order_id":"a\\u003ab","customer":"c","lines":[],"lines":[]}', "lines"),
        ],
    )
    def test_a_repeated_key_is_refused_by_name(self, value: bytes, key: str) -> None:
        assert refused(value) == (
            f"the payload has a duplicate key {key!r} in one object: parsers differ on which "
            "value counts, so send each key once"
        )

    def test_a_repeated_field_the_model_ignores_is_refused_too(self) -> None:
        assert "duplicate key 'extra'" in refused(b'{"n": 1, "extra": 1, "extra": 2}', Loose)

    def test_a_repeated_key_in_a_root_model_is_refused(self) -> None:
        assert "duplicate key 'a'" in refused(b'{"a": 1, "a": 2}', RootModel[dict[str, int]])

    def test_the_same_key_in_different_objects_is_fine(self) -> None:
        value = json.dumps(ORDER).encode()
        assert decoded(value) == Order.model_validate(ORDER)

    def test_a_long_repeated_key_is_shown_by_its_head_and_length(self) -> None:
        key = "k" * 5000
        reason = refused(json.dumps({"data": 1}).encode()[:-1]
                         + f', "{key}": 1, "{key}": 2}}'.encode(), Anything)
        assert "(5000 chars)" in reason
        assert len(reason) < 300


class TestFastPathStaysFast:
    """Strictness must not add a second parse to a well-formed message."""

    @pytest.fixture
    def second_parses(self, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
        calls: list[bytes] = []
        strict = decode_module._strict_json

        def counting(value: bytes, where: Any) -> Any:
            calls.append(value)
            return strict(value, where)

        monkeypatch.setattr(decode_module, "_strict_json", counting)
        return calls

    @pytest.mark.parametrize("pretty", [False, True])
    def test_a_typical_order_is_parsed_once(self, second_parses: list[bytes], pretty: bool) -> None:
        value = json.dumps(ORDER, indent=2 if pretty else None).encode()
        assert decoded(value) == Order.model_validate(ORDER)
        assert second_parses == []

    def test_non_ascii_and_escapes_are_parsed_once(self, second_parses: list[bytes]) -> None:
        order = {**ORDER, "notes": "grüße ✓ — 12:00", "customer": 'say "hi"\\n'}
        for ensure_ascii in (True, False):
            value = json.dumps(order, ensure_ascii=ensure_ascii).encode()
            assert decoded(value) == Order.model_validate(order)
        assert second_parses == []

    def test_a_parsed_datetime_hides_its_colons_so_the_exact_check_runs(
        self, second_parses: list[bytes]
    ) -> None:
        class Stamped(BaseModel):
            at: datetime

        assert decoded(b'{"at": "2024-05-01T10:15:00Z"}', Stamped)
        assert len(second_parses) == 1  # correct, just not the fast way


class TestCommonAndCheckedWaysAgree:
    """decode's short way for the usual message gives what the step-by-step way gives."""

    def test_a_repeated_key_of_a_plain_object_is_refused(self) -> None:
        registration = Registration("orders", payload_of(dict[str, Any]) or _payload(Loose))
        with pytest.raises(MalformedMessage, match="duplicate key 'a'"):
            decode(Record(b'{"a": 1, "a": 2}'), registration)
        assert decode(Record(b'{"a": 1, "b": "x:y"}'), registration).payload == {
            "a": 1, "b": "x:y"}

    def test_the_first_non_empty_id_of_a_repeated_header_counts(self) -> None:
        record = Record(b'{"n": 1}', headers=[("message-id", b""), ("message-id", b"m-2"),
                                             ("message-id", b"m-3")])
        assert decode(record, Registration("orders", _payload(Loose))).message_id == "m-2"

    def test_a_null_header_is_given_as_empty_bytes(self) -> None:
        record = Record(b'{"n": 1}', headers=[("message-id", b"m-1"), ("trace", None)])  # type: ignore[list-item]
        assert decode(record, Registration("orders", _payload(Loose))).headers == {
            "message-id": b"m-1", "trace": b""}


# --- property: refused exactly when some object names a key twice ----------------------------

Json = Any
_text = st.text(st.sampled_from("ab:é\"\\"), max_size=4)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), _text)
_pairs_trees = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        # an object as its pairs: keys drawn from a few, so repeats happen
        st.lists(st.tuples(st.sampled_from(["a", "b", "a:b", "é"]), inner), max_size=4).map(
            lambda pairs: ("object", pairs)
        ),
    ),
    max_leaves=10,
)


def _render(tree: Json, ensure_ascii: bool, escape_colons: bool) -> tuple[str, bool]:
    """JSON text of *tree* (objects as pairs, repeats kept) and whether a key repeats."""
    if isinstance(tree, tuple):
        parts = []
        keys = [k for k, _ in tree[1]]
        repeated = len(set(keys)) != len(keys)
        for key, value in tree[1]:
            text, inner = _render(value, ensure_ascii, escape_colons)
            repeated |= inner
            parts.append(f"{_string(key, ensure_ascii, escape_colons)}:{text}")
        return "{" + ",".join(parts) + "}", repeated
    if isinstance(tree, list):
        rendered = [_render(item, ensure_ascii, escape_colons) for item in tree]
        return "[" + ",".join(t for t, _ in rendered) + "]", any(r for _, r in rendered)
    if isinstance(tree, str):
        return _string(tree, ensure_ascii, escape_colons), False
    return json.dumps(tree), False


def _string(text: str, ensure_ascii: bool, escape_colons: bool) -> str:
    quoted = json.dumps(text, ensure_ascii=ensure_ascii)
    return quoted.replace(":", "\\u003a") if escape_colons else quoted


@settings(max_examples=400, deadline=None)
@given(tree=_pairs_trees, ensure_ascii=st.booleans(), escape_colons=st.booleans(),
       spaced=st.booleans())
def test_refused_exactly_when_an_object_repeats_a_key(
    tree: Json, ensure_ascii: bool, escape_colons: bool, spaced: bool
) -> None:
    text, repeated = _render(("object", [("data", tree)]), ensure_ascii, escape_colons)
    if spaced:
        text = text.replace(",", " , ").replace("{", "{ ")
    value = text.encode()
    if repeated:
        assert "duplicate key" in refused(value, Anything)
    else:
        assert decoded(value, Anything) == Anything(data=json.loads(text)["data"])


class Touchy(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def _no_sevens(cls, value: int) -> int:
        if value == 7:
            raise TypeError("a validator's own error, not a ValidationError")
        return value


def test_a_validator_error_while_decoding_ahead_leaves_the_batch_to_its_handling() -> None:
    # The loop decodes a polled batch ahead of its handling; a model's validator may raise
    # anything. That must not end the loop: the batch is decoded with its handling then, where
    # the error is the batch's failure (rewound, backed off), as before decoding moved.
    from consumers.runner import Runner  # noqa: PLC0415 - the runner's imports are heavy

    registrations = {"orders": Registration("orders", _payload(Touchy))}
    loop = SimpleNamespace(app=SimpleNamespace(registrations=registrations))
    assert Runner._decode_ahead(loop, [Record(b'{"n": 7}')]) is None  # type: ignore[arg-type]
    fine = Runner._decode_ahead(loop, [Record(b'{"n": 8}')])  # type: ignore[arg-type]
    assert fine is not None
    with pytest.raises(TypeError):
        decode_module.decode_many([Record(b'{"n": 7}')], registrations)  # type: ignore[list-item]
