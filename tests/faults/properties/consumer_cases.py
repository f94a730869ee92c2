"""Raw Kafka records for the consumer-input property: valid orders and many malformed ones.

Strategies build *templates*; :func:`realise` turns one into a record with a message id
unique to its position, so that no two records share a dedup key by accident. Whether a
record is valid is decided by :func:`expected_valid` from the consumer's documented rules
(a usable ``message-id`` header, a value, JSON that fits the handler's model), not by
running the consumer's code.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from pydantic import ValidationError

from consumers.decode import MAX_MESSAGE_ID_BYTES
from tests.faults.properties.consumer_app import Order

# kafka-python sends header values as bytes only (other clients can send null ones; the
# consumer reads those as empty).
Headers = list[tuple[str, bytes]]
PRODUCER_MAX_BYTES = 1_048_576  # kafka-python's max_request_size (and the broker's limit)
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark: refused (the contract is UTF-8 JSON without)


@dataclass(frozen=True)
class Template:
    kind: str
    id_shape: tuple[str, Any]  # how the message-id header looks (see realise)
    value: bytes | None
    key: bytes | None
    extra_headers: Headers


@dataclass(frozen=True)
class RawRecord:
    kind: str
    value: bytes | None
    key: bytes | None
    headers: Headers


def realise(template: Template, index: int) -> RawRecord:
    shape, detail = template.id_shape
    prefix = f"{index}-"
    header: bytes
    match shape:
        case "uuid":
            header = str(uuid.UUID(int=(0xFEED << 64) | index)).encode()
        case "text":
            header = (prefix + detail).encode()
        case "nul":
            header = (prefix + detail + "\x00").encode()
        case "huge":  # incompressible: PostgreSQL compresses a repetitive key into its index
            header = (prefix + random.Random(index).randbytes(detail // 2 + 1).hex()).encode()
        case "not-utf8":
            header = prefix.encode() + detail
        case "empty":
            header = b""
        case _:  # "missing"
            return RawRecord(template.kind, template.value, template.key, template.extra_headers)
    headers: Headers = [("message-id", header), *template.extra_headers]
    return RawRecord(template.kind, template.value, template.key, headers)


def _keyed(template: Template) -> Template:
    """kafka-python refuses a record with neither key nor value (a tombstone has a key)."""
    if template.value is None and template.key is None:
        return Template(template.kind, template.id_shape, None, b"k", template.extra_headers)
    return template


def message_id(record: RawRecord) -> str | None:
    """The dedup key the consumer must use, or None when the header is not usable: absent,
    empty, not UTF-8, containing NUL (PostgreSQL text cannot hold it) or over the bound."""
    values = [value for name, value in record.headers if name == "message-id"]
    if not values or not values[0]:
        return None
    raw = values[0]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\x00" in text or len(raw) > MAX_MESSAGE_ID_BYTES:
        return None
    return text


def expected_valid(record: RawRecord) -> bool:
    """The contract: UTF-8 JSON (no byte order mark), each key once per object, that fits
    the model; and a usable message id."""
    if message_id(record) is None or record.value is None:
        return False
    try:
        text = record.value.decode("utf-8")  # strict: no other encoding, no surrogates
        if text.startswith("\ufeff"):
            return False
        Order.model_validate(json.loads(text, object_pairs_hook=_each_key_once))
    except (ValueError, RecursionError, ValidationError):  # UnicodeDecodeError, JSONDecodeError
        return False
    return True


def _each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("a key is repeated")
    return dict(pairs)


# --- building blocks ---------------------------------------------------------------------

plain = st.text(st.characters(codec="ascii", categories=["L", "N"]), max_size=10)
any_text = st.text(max_size=10)  # NUL, surrogates, anything
good_order = st.fixed_dictionaries(
    {"n": st.integers(-(2**31), 2**31 - 1)},
    optional={
        "label": st.text(st.sampled_from("AZaz09 _.-"), max_size=12),
        "tags": st.dictionaries(any_text, st.integers(-5, 5), max_size=3),
    },
)
bad_order = st.one_of(
    st.fixed_dictionaries({}, optional={"label": plain}),  # no n
    st.fixed_dictionaries({"n": st.one_of(st.text(max_size=5), st.floats(), st.lists(
        st.integers(), max_size=2), st.just(2**31), st.just(-(2**31) - 1), st.none())}),
    st.fixed_dictionaries({"n": st.integers(0, 9), "label": any_text.filter(
        lambda s: any(c not in "AZaz09 _.-" for c in s))}),
    st.fixed_dictionaries({"n": st.integers(0, 9), "tags": st.one_of(
        st.lists(st.integers(), max_size=2), st.dictionaries(any_text, any_text, min_size=1,
                                                             max_size=2))}),
    # unknown fields (extra="forbid"); their names appear in the error: NUL, surrogates...
    st.dictionaries(any_text.filter(lambda k: k not in {"n", "label", "tags"}),
                    st.integers(), min_size=1, max_size=3).map(lambda d: {"n": 1, **d}),
    st.one_of(st.lists(st.integers(), max_size=3), st.integers(), any_text, st.none(),
              st.booleans()),  # not an object at all
)


def _dumps(value: Any, ascii_only: bool, pretty: bool) -> bytes:
    # ensure_ascii=True writes \u0000 and lone surrogates as escapes: valid JSON text
    # whose decoded strings PostgreSQL and UTF-8 cannot take.
    text = json.dumps(value, ensure_ascii=ascii_only, indent=2 if pretty else None)
    return text.encode("utf-8", "surrogatepass")


def json_bytes(values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.builds(_dumps, values, st.booleans(), st.booleans())


keys = st.one_of(st.none(), st.binary(max_size=12))
garbled_headers: st.SearchStrategy[Headers] = st.lists(
    st.tuples(
        st.one_of(any_text, st.just("traceparent"), st.just("run-id")).filter(
            lambda n: n != "message-id" and _encodable(n)
        ),
        st.one_of(st.binary(max_size=12), st.just(b"\x00"), st.just(b"\xff\xfe")),
    ),
    max_size=3,
)
good_id = st.one_of(st.just(("uuid", None)), plain.map(lambda s: ("text", s)))


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")  # Kafka header names are UTF-8 strings (kafka-python encodes)
    except UnicodeEncodeError:
        return False
    return True


def _nested(depth: int) -> bytes:
    return b'{"n": 1, "tags": ' + b"[" * depth + b"]" * depth + b"}"


def _padded(order: dict[str, Any], size: int) -> bytes:
    """A valid order, padded with JSON whitespace to *size* bytes."""
    body = json.dumps(order).encode()
    return body + b" " * max(0, size - len(body))


def _repeated(order: dict[str, Any], key: str, nested: bool) -> bytes:
    """A valid order whose JSON names *key* twice (in ``tags`` when *nested*)."""
    if nested:
        body = json.dumps({**order, "tags": {}})
        return body.replace('"tags": {}', '"tags": {"k": 1, "k": 2}').encode()
    order = {key: {"n": 1, "label": "", "tags": {}}[key], **order}
    repeat = json.dumps({key: order[key]})
    return (json.dumps(order)[:-1] + ", " + repeat[1:]).encode()


NO_HEADERS: st.SearchStrategy[Headers] = st.just([])


def _template(kind: str, id_shape: Any, value: Any, extra: Any = NO_HEADERS) -> Any:
    return st.builds(Template, st.just(kind), id_shape, value, keys, extra).map(_keyed)


KINDS: dict[str, tuple[int, st.SearchStrategy[Template]]] = {
    # name: (share of the cases, strategy)
    "valid": (200, _template("valid", good_id, json_bytes(good_order))),
    "valid-garbled-extra-headers": (
        80, _template("valid-garbled-extra-headers", good_id, json_bytes(good_order),
                      garbled_headers)),
    "valid-near-size-limit": (4, _template(
        "valid-near-size-limit", good_id,
        st.builds(_padded, good_order, st.integers(900_000, PRODUCER_MAX_BYTES - 2_000)))),
    "not-json": (60, _template("not-json", good_id, st.one_of(
        st.binary(max_size=40), any_text.map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.just(b""), st.just(b"{"), st.just(b'{"n": 1'), st.just(b"\xef\xbb\xbf{]")))),
    "invalid-utf8": (40, _template("invalid-utf8", good_id, st.binary(max_size=20).map(
        lambda b: b'{"n": 1, "label": "' + b"\xff\xc3" + b + b'"}'))),
    "wrong-schema": (200, _template("wrong-schema", good_id, json_bytes(bad_order),
                                    st.one_of(NO_HEADERS, garbled_headers))),
    "other-unicode-encoding": (30, _template("other-unicode-encoding", good_id, st.tuples(
        json_bytes(good_order), st.sampled_from(["utf-16", "utf-16-le", "utf-16-be", "utf-32",
                                                 "utf-32-le"])).map(
        lambda t: t[0].decode("utf-8", "surrogatepass").encode(t[1], "surrogatepass")))),
    "utf8-byte-order-mark": (20, _template(
        "utf8-byte-order-mark", good_id, json_bytes(good_order).map(lambda b: BOM + b))),
    "duplicate-key": (30, _template("duplicate-key", good_id, st.builds(
        _repeated, good_order, st.sampled_from(["n", "label", "tags"]), st.booleans()))),
    "deeply-nested": (40, _template("deeply-nested", good_id,
                                    st.integers(1_000, 200_000).map(_nested))),
    "tombstone": (40, _template("tombstone", good_id, st.none())),
    "no-message-id": (40, _template("no-message-id", st.just(("missing", None)),
                                    json_bytes(good_order), garbled_headers)),
    "empty-message-id": (30, _template(
        "empty-message-id", st.just(("empty", None)),
        json_bytes(good_order))),
    "message-id-not-utf8": (40, _template(
        "message-id-not-utf8", st.binary(max_size=8).map(lambda b: ("not-utf8", b"\xff" + b)),
        json_bytes(good_order))),
    "message-id-with-nul": (40, _template(
        "message-id-with-nul", plain.map(lambda s: ("nul", s)), json_bytes(good_order),
        st.one_of(NO_HEADERS, garbled_headers))),
    "message-id-too-long": (30, _template(
        "message-id-too-long", st.integers(MAX_MESSAGE_ID_BYTES, 20_000).map(
            lambda n: ("huge", n)), json_bytes(good_order))),
    "malformed-near-size-limit": (8, _template(
        "malformed-near-size-limit", good_id,
        # over the limit once the dead-letter copy adds its error headers (a few hundred
        # bytes), while the original still fits
        st.integers(PRODUCER_MAX_BYTES - 1_200, PRODUCER_MAX_BYTES - 500).map(
            lambda size: b'{"n": 1, "pad": "' + b"x" * size + b'"}'))),
    "garbled-everything": (200, _template(
        "garbled-everything",
        st.one_of(good_id, st.just(("missing", None)), plain.map(lambda s: ("nul", s))),
        st.one_of(st.none(), st.binary(max_size=30), json_bytes(st.one_of(good_order,
                                                                          bad_order))),
        garbled_headers)),
}
"""Every kind of input, with how many cases of it to generate."""
