"""The message an agent emits, and its validation into the exact bytes Kafka will get.

An :class:`Envelope` is checked for types when built; its content (topic name, NUL
characters, encodability, size, required keys) is checked by :func:`encode`, which
:func:`outbox.messages.emit.emit` calls before it sends any statement, so a rejected message leaves
the caller's transaction untouched. Either refusal is an :class:`~outbox.errors.InvalidMessage`
naming the field.

The size rule (:func:`record_size`) counts the Kafka record the relay will send, framing and
compression included, so that a message emit accepts is one the relay can publish.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from outbox.errors import InvalidMessage
from outbox.messages.ids import uuid7
from outbox.runtime import tracing
from outbox.settings import OutboxSettings

# Kafka's own rule (kafka.common.internals.Topic): 1-249 of these, and not "." or "..".
_TOPIC = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")

# Kafka header names outboxkit writes; consumers read the dedup key from "message-id".
HEADER_MESSAGE_ID = "message-id"
HEADER_TYPE = "message-type"
HEADER_CREATED_AT = "created-at"
HEADER_CORRELATION_ID = "correlation-id"
HEADER_CAUSATION_ID = "causation-id"
HEADER_RUN_ID = "run-id"
HEADER_WORKFLOW_VERSION = "workflow-version"
HEADER_SCHEMA_VERSION = "schema-version"
HEADER_TRACEPARENT = "traceparent"
HEADER_TRACESTATE = "tracestate"
_TRACE_HEADERS = frozenset({HEADER_TRACEPARENT, HEADER_TRACESTATE})
# Names only outboxkit writes, from the Envelope's fields, whether or not the field is set:
# a hand-made "run-id" header would point a consumer's ctx.confirm at another run.
_OWN_HEADERS = frozenset({
    HEADER_MESSAGE_ID, HEADER_TYPE, HEADER_CREATED_AT, HEADER_CORRELATION_ID,
    HEADER_CAUSATION_ID, HEADER_RUN_ID, HEADER_WORKFLOW_VERSION, HEADER_SCHEMA_VERSION,
})

# What a message costs on the wire besides its bytes, as kafka-python's producer estimates it
# before refusing a record over max.request.size (and the broker a batch over
# max.message.bytes): a lone record travels in a batch of its own (61 bytes of header), and
# a record's own framing (length, attributes, timestamp and offset deltas) is at most 21.
RECORD_BATCH_OVERHEAD = 61
RECORD_OVERHEAD = 21
# A relay that traces sends its publish span's traceparent (55 characters) instead of the
# emit's, or adds one to a message emitted without: room is kept for it.
_TRACEPARENT_LENGTH = 55
# Compression cannot shrink random bytes (a base64 image) and adds its own framing; the
# worst of the relay's codecs on incompressible data (gzip: 5 bytes per 16 KiB block and
# an 18-byte header; snappy about the same, lz4 and zstd less) stays under this.
COMPRESSION_ROOM_FIXED = 64
COMPRESSION_ROOM_PER_16_KIB = 6

MAX_PAYLOAD_DEPTH = 500
"""Deepest nesting of lists/objects a payload may have: every consumer's JSON parser (Python's
stops near 1,000 levels, less when its stack is already deep) can read what emit accepts."""


class Envelope(BaseModel):
    """A message for Kafka, written to the outbox by :func:`outbox.messages.emit.emit`.

    ``message_id`` is the consumers' dedup key: keep the same id when the same logical
    message is emitted again (a retried step), never mint a new one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    topic: str
    type: str
    payload: Any = Field(
        description="Any JSON value: dicts with str keys, lists, str, int, finite float, bool, "
        f"None, nested at most {MAX_PAYLOAD_DEPTH} levels; sent as compact UTF-8 JSON."
    )
    key: str | bytes | None = Field(
        default=None, description="Kafka key: one key, one partition, in commit order."
    )
    # Time-ordered (version 7, outbox.messages.ids): cheap to index in every consumer's dedup marks.
    message_id: uuid.UUID = Field(default_factory=uuid7)
    correlation_id: str | None = None
    causation_id: str | None = None
    run_id: uuid.UUID | None = None
    workflow_version: str | None = None
    schema_version: str | None = None
    headers: dict[str, str] = Field(
        default_factory=dict, description="Extra Kafka headers (string values)."
    )
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @model_validator(mode="wrap")
    @classmethod
    def _one_error_type(cls, data: Any, handler: ModelWrapValidatorHandler[Envelope]) -> Envelope:
        """A wrong type is refused as :class:`InvalidMessage`, like every other bad field.

        One type to catch, whether the envelope is built or emitted; pydantic's
        ``ValidationError`` (all its errors) stays attached as ``__cause__``.
        """
        try:
            return handler(data)
        except ValidationError as exc:
            raise _refused(exc) from exc


def _refused(exc: ValidationError) -> InvalidMessage:
    """The first bad field pydantic found, named the way :func:`encode` names fields."""
    errors = exc.errors(include_url=False)
    if not errors:  # pydantic always lists at least one; keep a usable message regardless
        return InvalidMessage("envelope", str(exc))
    field = _field_of(errors[0])
    # A union (key: str | bytes | None) fails once per member: one reason lists them all.
    mine = [e for e in errors if _field_of(e) == field]
    reason = " or ".join(dict.fromkeys(_reason(e) for e in mine))
    if mine[0]["type"] not in _NO_INPUT:
        # The input's type only: the value itself can be megabytes, or a secret.
        reason += f" (got {type(mine[0]['input']).__name__})"
    others = sorted({_field_of(e) for e in errors} - {field})
    if others:
        reason += f" (also invalid: {', '.join(others)})"
    return InvalidMessage(field, reason)


def _field_of(error: ErrorDetails) -> str:
    loc = error["loc"]
    if not loc:
        return "envelope"
    if loc[0] == "headers" and len(loc) > 1:
        return f"headers[{_quoted(loc[1])}]"
    return str(loc[0])


_NO_INPUT = frozenset({"missing", "extra_forbidden"})


def _reason(error: ErrorDetails) -> str:
    if error["type"] == "missing":
        return "is required"
    if error["type"] == "extra_forbidden":
        return f"is not a field of Envelope (the fields are {', '.join(Envelope.model_fields)})"
    message = error["msg"]
    return "s" + message[len("Input s"):] if message.startswith("Input should") else message


@dataclass(frozen=True)
class EncodedMessage:
    """An envelope validated and turned into the values of one ``outbox_messages`` row."""

    message_id: uuid.UUID
    topic: str
    key: bytes | None
    type: str
    payload: bytes
    headers: dict[str, str]
    run_id: uuid.UUID | None

    @property
    def size(self) -> int:
        """The most bytes the relay's Kafka record of this message can take: the rule emit
        holds to ``max_message_bytes`` (see :func:`record_size`)."""
        return record_size(self.key, self.payload, self.headers)


def record_size(key: bytes | None, payload: bytes, headers: Mapping[str, str]) -> int:
    """Upper bound of the bytes a relay with any settings sends for one message.

    Counted as the relay's producer counts a record before it refuses it
    (``max_request_bytes``) and as the broker counts the batch that carries it
    (``max.message.bytes``): key, payload and the headers the relay puts on the record
    (these, plus a traceparent a tracing relay may add), each with its varint length, the
    record's and its batch's framing, and room for compression to grow incompressible data.
    So what emit accepts under a limit is publishable by a relay whose ``max_request_bytes``
    and topic's ``max.message.bytes`` are at least that limit (1 MiB each by default).
    """
    names = headers.keys() | {HEADER_TRACEPARENT}
    header_bytes = _varint_size(len(names))
    for name in names:
        value = len(headers.get(name, "").encode())
        if name == HEADER_TRACEPARENT:
            value = max(value, _TRACEPARENT_LENGTH)
        header_bytes += _with_length(len(name.encode())) + _with_length(value)
    body = (
        (1 if key is None else _with_length(len(key)))
        + _with_length(len(payload))
        + header_bytes
    )
    record = RECORD_BATCH_OVERHEAD + RECORD_OVERHEAD + body
    blocks = -(-record // 16_384)
    return record + COMPRESSION_ROOM_FIXED + COMPRESSION_ROOM_PER_16_KIB * blocks


def _with_length(size: int) -> int:
    return _varint_size(size) + size


def _varint_size(value: int) -> int:
    """Bytes of Kafka's zigzag varint of *value* (a length: never negative)."""
    return max(1, ((value << 1).bit_length() + 6) // 7)


def encode(envelope: Envelope, settings: OutboxSettings) -> EncodedMessage:
    """Validate *envelope* against every rule and return its row values.

    Raises :class:`InvalidMessage` naming the offending field; nothing touches a database.
    """
    if not _TOPIC.match(envelope.topic) or envelope.topic in {".", ".."}:
        raise InvalidMessage("topic", _topic_problem(envelope.topic))
    _check_text("type", envelope.type)
    if not envelope.type:
        raise InvalidMessage("type", "is empty: name the kind of message (e.g. 'order.placed')")

    key: bytes | None
    if isinstance(envelope.key, str):
        _check_text("key", envelope.key)
        key = envelope.key.encode("utf-8")
    else:
        key = envelope.key
    if key is None and envelope.topic in settings.ordered_topics:
        raise InvalidMessage(
            "key",
            f"topic {envelope.topic!r} is declared ordered (settings.ordered_topics): give the "
            "message the key its order is kept by",
        )

    # Walk first: it names where bad text or a non-str key is, and bounds the depth (so a
    # cycle or a deep payload cannot exhaust the stack in json.dumps or in a consumer).
    _check_json(envelope.payload)
    try:
        text = json.dumps(
            envelope.payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidMessage(
            "payload",
            f"is not JSON-serialisable ({exc}): convert it to dicts, lists, str, "
            "int, float (finite), bool or None first",
        ) from exc
    payload = text.encode("utf-8")

    headers = _headers(envelope)
    message = EncodedMessage(
        message_id=envelope.message_id,
        topic=envelope.topic,
        key=key,
        type=envelope.type,
        payload=payload,
        headers=headers,
        run_id=envelope.run_id,
    )
    size = message.size
    if size > settings.max_message_bytes:
        raise InvalidMessage(
            "message",
            f"is {size} bytes as a Kafka record (payload {len(payload)}, key {len(key or b'')}, "
            f"headers, framing and compression room {size - len(payload) - len(key or b'')}), "
            f"over settings.max_message_bytes ({settings.max_message_bytes}): store the bulk "
            "as an artifact and send a reference",
        )
    return message


def _topic_problem(topic: str) -> str:
    """Why Kafka would refuse *topic*; a long name is shown by its head and length only."""
    rule = "use 1-249 characters of a-z A-Z 0-9 . _ - (and not '.' or '..')"
    if not topic:
        return f"is empty: {rule}"
    if len(topic) > _MAX_TOPIC:
        return f"{_quoted(topic)} is too long: {rule}"
    bad = next((i for i, char in enumerate(topic) if not _TOPIC.match(char)), None)
    if bad is None:  # "." or ".."
        return f"{topic!r} is not a Kafka topic name: {rule}"
    return f"{_quoted(topic)} has {topic[bad]!r} at offset {bad}: {rule}"


_MAX_TOPIC = 249
_QUOTE_LIMIT = 60


def _quoted(value: object) -> str:
    """``repr`` of *value*, or for a long string its head and its length: an error message
    (and the log line it ends up in) should not carry a 10 kB name."""
    if isinstance(value, str) and len(value) > _QUOTE_LIMIT:
        return f"{value[:_QUOTE_LIMIT // 2]!r}... ({len(value)} characters)"
    return repr(value)


def _headers(envelope: Envelope) -> dict[str, str]:
    headers = {
        HEADER_MESSAGE_ID: str(envelope.message_id),
        HEADER_TYPE: envelope.type,
        HEADER_CREATED_AT: envelope.created_at.isoformat(),
    }
    optional = {
        HEADER_CORRELATION_ID: envelope.correlation_id,
        HEADER_CAUSATION_ID: envelope.causation_id,
        HEADER_RUN_ID: str(envelope.run_id) if envelope.run_id else None,
        HEADER_WORKFLOW_VERSION: envelope.workflow_version,
        HEADER_SCHEMA_VERSION: envelope.schema_version,
    }
    headers.update({name: value for name, value in optional.items() if value is not None})
    if not _TRACE_HEADERS & envelope.headers.keys():
        # A context the caller set explicitly (one carried over from elsewhere) wins.
        headers.update(current_trace_headers())
    for name, value in envelope.headers.items():
        _check_text(f"headers[{_quoted(name)}]", name)
        if name in headers or name in _OWN_HEADERS:
            raise InvalidMessage(
                f"headers[{_quoted(name)}]", "is set by outboxkit: use the Envelope field instead"
            )
        headers[name] = value
    for name, value in headers.items():
        _check_text(f"headers[{_quoted(name)}]", value)
    return headers


def current_trace_headers() -> dict[str, str]:
    """W3C ``traceparent``/``tracestate`` of the active OpenTelemetry span, if any.

    OpenTelemetry is optional: without it installed, or without an active span, this is empty.
    Inside :func:`outbox.messages.emit.emit` the active span is its ``outbox.emit`` span.
    """
    return tracing.trace_headers()


def _check_text(field: str, value: str) -> None:
    """Text must survive PostgreSQL text/jsonb and UTF-8 on the consumer's side."""
    if "\x00" in value:
        raise InvalidMessage(
            field, f"contains a NUL character at offset {value.index(chr(0))}: remove it"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessage(
            field,
            f"is not valid UTF-8 (lone surrogate at offset {exc.start}): "
            "decode your input with errors='replace' or fix its source",
        ) from exc


def _check_json(payload: Any) -> None:
    """Walk the payload so an error names where the problem is (``payload.items[3].name``).

    Iterative, with an explicit depth bound: no payload can exhaust the stack here.
    """
    pending: list[tuple[str, Any, int]] = [("payload", payload, 0)]
    while pending:
        path, value, depth = pending.pop()
        if isinstance(value, str):
            _check_text(path, value)
            continue
        if not isinstance(value, Mapping | list | tuple):
            continue  # scalars; json.dumps judges the other types
        if depth >= MAX_PAYLOAD_DEPTH:
            raise InvalidMessage(
                "payload",
                f"is nested more than {MAX_PAYLOAD_DEPTH} levels deep (or contains itself): "
                "flatten it, or store it as an artifact and send a reference",
            )
        children: list[tuple[str, Any, int]] = []
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidMessage(
                        f"{path}.<key {key!r:.40}>",
                        f"is a {type(key).__name__}: JSON object keys are strings; convert it "
                        "yourself (json.dumps would, and could make two keys the same)",
                    )
                _check_text(f"{path}.<key {key[:40]!r}>", key)
                children.append((f"{path}.{key}", item, depth + 1))
        else:
            children = [(f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value)]
        pending.extend(reversed(children))  # depth-first, in order: the first fault is named
