"""Turning a Kafka record into (context, payload), or naming why it cannot be.

The contract is what the relay sends: UTF-8 JSON (RFC 8259), each object naming a key once.
Anything else is malformed and dead-lettered, whichever parser would have guessed what it
meant: UTF-16 or UTF-32 text, bytes that are not UTF-8, a UTF-8 byte order mark (RFC 8259
forbids senders to add one; refused rather than skipped so that every reader, replays
included, sees the same bytes the same way) and duplicate keys (parsers disagree on which
value counts). A handler that takes ``bytes`` gets the value as it is: none of this applies.
"""

from __future__ import annotations

import codecs
import itertools
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError
from sqlalchemy import Connection

from consumers.context import HandlerContext
from consumers.deferred import DeferredInserts
from consumers.errors import MalformedMessage
from consumers.handlers import Payload, Registration
from outbox.kafka import Record
from outbox.messages.envelope import HEADER_MESSAGE_ID, HEADER_RUN_ID
from outbox.settings import OutboxSettings

MAX_MESSAGE_ID_BYTES = 512
"""Longest usable ``message-id`` header: the dedup key must fit PostgreSQL's index (the relay
sends 36-character UUIDs)."""


class Decoded(NamedTuple):
    """A record whose message id and payload passed validation.

    A named tuple, not a dataclass: one is made per message, and a tuple is built several
    times faster (immutable and compared by value all the same).
    """

    record: Record
    message_id: str
    headers: dict[str, bytes]
    payload: Any

    def context(
        self,
        conn: Connection,
        group_id: str,
        settings: OutboxSettings,
        deferred: DeferredInserts | None = None,
    ) -> HandlerContext:
        record = self.record
        return HandlerContext.of(
            conn=conn,
            group_id=group_id,
            message_id=self.message_id,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key,
            headers=self.headers,
            run_id=_run_id(self.headers.get(HEADER_RUN_ID)),
            outbox_settings=settings,
            deferred=deferred,
        )


def contexts(
    conn: Connection,
    group_id: str,
    settings: OutboxSettings,
    deferred: DeferredInserts | None = None,
) -> Callable[[Decoded], HandlerContext]:
    """``Decoded.context`` for the messages of one transaction (made once, called per
    message: what they share is not passed again each time)."""
    make = HandlerContext.factory(conn, group_id, settings, deferred)

    def context(d: Decoded) -> HandlerContext:
        record, headers = d.record, d.headers
        run_id = headers.get(HEADER_RUN_ID)
        return make(d.message_id, record.topic, record.partition, record.offset, record.key,
                    headers, _run_id(run_id) if run_id else None)

    return context


def message_id_of(record: Record) -> str | None:
    """The ``message-id`` header (what the relay sends), or None when it is not usable."""
    message_id, _ = _message_id(record)
    return message_id


def _message_id(record: Record) -> tuple[str | None, str]:
    """The usable message id, or None and why not (absent, empty, not UTF-8, NUL, too long).

    The id is the dedup key, stored as PostgreSQL text in a unique index: one that cannot
    be stored would fail the batch on every redelivery, so it is refused here instead.
    """
    for name, value in record.headers or ():
        if name == HEADER_MESSAGE_ID and value:
            raw = bytes(value)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                return None, f"the {HEADER_MESSAGE_ID!r} header is not UTF-8"
            if "\x00" in text:
                return None, f"the {HEADER_MESSAGE_ID!r} header contains a NUL character"
            if len(raw) > MAX_MESSAGE_ID_BYTES:
                return None, (f"the {HEADER_MESSAGE_ID!r} header is {len(raw)} bytes, over "
                              f"the {MAX_MESSAGE_ID_BYTES} a dedup key may have")
            return text, ""
    return None, f"no {HEADER_MESSAGE_ID!r} header (the dedup key)"


def decode(record: Record, registration: Registration | None) -> Decoded:
    """Validate *record* for its topic's handler.

    Raises:
        MalformedMessage: no handler for the topic, no usable message id, no value, not
            JSON (or nested too deeply to parse), wrong schema. A handler that takes
            ``bytes`` gets any value but None.
    """
    if registration is None:
        return _decode_checked(record, registration)
    decoded, error = decode_many((record,), {record.topic: registration})
    if error is not None:
        raise error
    return decoded[0]


Decoding = tuple[list[Decoded], MalformedMessage | None]
"""What :func:`decode_many` gives: the records decoded, up to the first malformed one's error."""


def decode_many(
    records: Sequence[Record], registrations: Mapping[str, Registration]
) -> Decoding:
    """:func:`decode` of each of *records* in turn (its topic's registration from
    *registrations*), up to the first malformed one: the decoded, and that one's error.

    The message the relay sends goes a short way, in this one loop (a consumer's own CPU
    is mostly here): the headers' dict made once and the id looked up in it, a model's
    repeated keys ruled out by a count. Anything unusual (a header named twice, a null
    header, an id or value not plain bytes, a payload that does not validate, a count that
    does not settle it) goes :func:`_decode_checked`'s way, which gives the same answer
    and names any problem.
    """
    decoded: list[Decoded] = []
    append, registration_of, new = decoded.append, registrations.get, Decoded._make
    for record in records:
        registration = registration_of(record.topic)
        pairs = record.headers or ()
        headers = dict(pairs)
        raw = headers.get(HEADER_MESSAGE_ID)
        value = record.value
        if (registration is None or len(headers) != len(pairs) or type(raw) is not bytes
                or not raw or len(raw) > MAX_MESSAGE_ID_BYTES or b"\x00" in raw
                or type(value) is not bytes or None in headers.values()):
            payload = message_id = _CHECK
        else:
            payload, message_id = _payload_of(value, raw, registration.payload)
        if payload is _CHECK:
            try:
                append(_decode_checked(record, registration))
            except MalformedMessage as exc:
                return decoded, exc
        else:
            append(new((record, message_id, headers, payload)))
    return decoded, None


_CHECK: Any = object()  # decode_many: this one goes the checked way


def _payload_of(value: bytes, raw_id: bytes, kind: Payload) -> tuple[Any, Any]:
    """(payload, message id) of the usual message, or (_CHECK, _CHECK)."""
    try:
        message_id = raw_id.decode("utf-8")
    except UnicodeDecodeError:
        return _CHECK, _CHECK
    if kind.raw:
        return value, message_id
    try:
        payload = kind.validate_json(value)
    except ValidationError:
        return _CHECK, _CHECK
    # A model's fields set (a dict's keys) each came from a distinct key of the top object
    # (a validator that invents fields aside, as in _kept_keys_and_colons), and every key
    # of the text ends at a ':' outside strings. So as many ':' as those means no other
    # key, nested or repeated, and no ':' in a string: the walk would find the same.
    # Otherwise the walk decides.
    top = getattr(payload, "__pydantic_fields_set__", payload if type(payload) is dict else None)
    if ((top is None or value.count(b":") != len(top))
            and _kept_keys_and_colons(payload, len(value)) != _colons(value)):
        return _CHECK, _CHECK  # maybe a repeated key: the checked way parses again, says
    return payload, message_id


def _decode_checked(record: Record, registration: Registration | None) -> Decoded:
    """:func:`decode` step by step, each problem named."""
    where = (record.topic, record.partition, record.offset)
    if registration is None:
        raise MalformedMessage(*where, f"no handler is registered for topic {record.topic!r}")
    message_id, problem = _message_id(record)
    if message_id is None:
        raise MalformedMessage(*where, problem)
    if record.value is None:
        raise MalformedMessage(*where, "the record has no value")
    headers = {name: bytes(value or b"") for name, value in record.headers or ()}
    value = record.value if isinstance(record.value, bytes) else bytes(record.value)
    kind = registration.payload
    if kind.raw:
        return Decoded(record, message_id, headers, value)
    try:
        # The fast path: pydantic parses and validates the bytes in one pass (about three
        # times faster than json.loads and model_validate). Its parser takes only UTF-8
        # without a BOM, but keeps the last of a repeated key silently: a count over the
        # result rules repeats out without a second parse (see _kept_keys_and_colons).
        payload = kind.validate_json(value)
    except ValidationError:
        pass
    else:
        if _kept_keys_and_colons(payload, len(value)) != _colons(value):
            _strict_json(value, where)  # raises on a repeated key; usually there is none
        return Decoded(record, message_id, headers, payload)
    # Any refusal goes the slow way, so that what is accepted, and the error a refusal
    # names, stay those of Python's json module (it takes NaN and deeper nesting).
    data = _strict_json(value, where)
    try:
        payload = kind.validate_python(data)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise MalformedMessage(
            *where, f"the payload does not match {kind.name}: {detail}"
        ) from exc
    return Decoded(record, message_id, headers, payload)


class _RepeatedKey(Exception):
    """Raised from inside ``json.loads`` (not a ValueError: that would read as bad syntax)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return data


def _strict_json(value: bytes, where: tuple[str, int, int]) -> Any:
    """*value* parsed as UTF-8 JSON whose objects name each key once; else MalformedMessage."""
    not_utf8 = "the payload is not UTF-8 JSON"
    if value.startswith(codecs.BOM_UTF8):
        raise MalformedMessage(
            *where, f"{not_utf8}: it starts with a byte order mark (EF BB BF); send it without"
        )
    if b"\x00" in value:  # JSON text has no NUL byte; UTF-16 and UTF-32 JSON are full of them
        raise MalformedMessage(
            *where,
            f"{not_utf8}: it has a NUL byte at offset {value.index(0)} (UTF-16 or UTF-32?)",
        )
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedMessage(
            *where, f"{not_utf8}: byte 0x{value[exc.start]:02x} at offset {exc.start} is not "
            "UTF-8",
        ) from exc
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:
        shown = exc.key if len(exc.key) <= 60 else f"{exc.key[:30]}... ({len(exc.key)} chars)"
        raise MalformedMessage(
            *where,
            f"the payload has a duplicate key {shown!r} in one object: parsers differ on which "
            "value counts, so send each key once",
        ) from exc
    except ValueError as exc:
        raise MalformedMessage(*where, f"the payload is not JSON: {exc}") from exc
    except RecursionError as exc:  # not a ValueError: it would fail the batch for ever
        raise MalformedMessage(*where, "the payload is JSON nested too deeply to parse") from exc


def _colons(value: bytes) -> int:
    """':' in the JSON text, escaped ones (\\u003a) included: one per key, plus those in
    strings."""
    return value.count(b":") + value.count(b"\\u003a") + value.count(b"\\u003A")


def _kept_keys_and_colons(payload: Any, size: int) -> int:
    """Keys the validated *payload* kept plus the ':' in its strings: a repeated key is
    certainly absent from the JSON it came from when this reaches :func:`_colons` of it.

    Each ':' of JSON text outside a string ends a key, so the text holds at most
    ``_colons`` keys plus string colons. A key named twice in one object is kept once,
    which leaves this count short of it. Whatever the walk does not know (a datetime
    parsed from text, a dataclass, an ignored extra field) only lowers the count, which
    sends the message to the exact check in :func:`_strict_json`. The one blind spot: a
    model whose own validators invent keys or ':' characters can hide a repeat.

    JSON of *size* bytes holds at most *size* values: a walk longer than that went through
    something no parser made (a cycle a validator built) and gives up (-1).
    """
    count = 0
    pending: list[Any] = [payload]
    while pending:
        size -= 1
        if size < 0:
            return -1
        value = pending.pop()
        kind = _KINDS.get(type(value))
        if kind is None:
            kind = _classify(type(value))
        if kind == _TEXT:
            count += value.count(":")
            continue
        if kind == _OTHER:
            continue
        keys, children = _opened(value, kind)
        count += keys
        # Leaves are handled here rather than pushed: most values are leaves.
        for child in children:
            leaf = type(child)
            if leaf is str:
                count += child.count(":")
            elif leaf not in _SCALARS:
                pending.append(child)
    return count


def _opened(value: Any, kind: int) -> tuple[int, Iterable[Any]]:
    """The keys a container holds, and its values (for a mapping, its keys too)."""
    if kind == _MODEL:
        fields = value.__pydantic_fields_set__  # extra fields included
        declared = value.__dict__
        if len(fields) == len(declared) and not value.__pydantic_extra__:
            return len(fields), declared.values()  # every field given: common, cheaper
        return len(fields), [getattr(value, name) for name in fields]
    if kind == _MAPPING:
        return len(value), itertools.chain(value, value.values())
    if kind == _ROOT:
        return 0, (value.root,)  # a root is not a key of the JSON
    return 0, value  # a sequence


_SCALARS = frozenset({int, float, bool, type(None)})
# What each type is to the walk, cached per type: isinstance against pydantic's (ABC)
# metaclass on every value would cost more than parsing a small payload (and plain ints,
# because looking up an Enum member costs more than the rest of a step).
_OTHER, _TEXT, _SEQUENCE, _MAPPING, _MODEL, _ROOT = range(6)
_KINDS: dict[type, int] = {
    str: _TEXT, int: _OTHER, float: _OTHER, bool: _OTHER,
    type(None): _OTHER, list: _SEQUENCE, tuple: _SEQUENCE, dict: _MAPPING,
}


def _classify(kind: type) -> int:
    if issubclass(kind, BaseModel):
        found = _ROOT if kind.__pydantic_root_model__ else _MODEL
    elif issubclass(kind, str):  # a StrEnum member: the text it came from
        found = _TEXT
    elif issubclass(kind, Mapping):
        found = _MAPPING
    elif issubclass(kind, list | tuple | set | frozenset):
        found = _SEQUENCE
    else:
        found = _OTHER
    _KINDS[kind] = found
    return found


def _run_id(raw: bytes | None) -> uuid.UUID | None:
    if not raw:
        return None
    try:
        return uuid.UUID(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None
