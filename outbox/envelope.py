"""The message an agent emits, and its validation into the exact bytes Kafka will get.

An :class:`Envelope` is checked for types when built; its content (topic name, NUL
characters, encodability, size, required keys) is checked by :func:`encode`, which
:func:`outbox.emit.emit` calls before it sends any statement, so a rejected message leaves
the caller's transaction untouched.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox import tracing
from outbox.errors import InvalidMessage
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

MAX_PAYLOAD_DEPTH = 500
"""Deepest nesting of lists/objects a payload may have: every consumer's JSON parser (Python's
stops near 1,000 levels, less when its stack is already deep) can read what emit accepts."""


class Envelope(BaseModel):
    """A message for Kafka, written to the outbox by :func:`outbox.emit.emit`.

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
    message_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    correlation_id: str | None = None
    causation_id: str | None = None
    run_id: uuid.UUID | None = None
    workflow_version: str | None = None
    schema_version: str | None = None
    headers: dict[str, str] = Field(
        default_factory=dict, description="Extra Kafka headers (string values)."
    )
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


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
        """Bytes Kafka will count against ``max.message.bytes`` (record overhead aside)."""
        header_bytes = sum(len(k.encode()) + len(v.encode()) for k, v in self.headers.items())
        return len(self.key or b"") + len(self.payload) + header_bytes


def encode(envelope: Envelope, settings: OutboxSettings) -> EncodedMessage:
    """Validate *envelope* against every rule and return its row values.

    Raises :class:`InvalidMessage` naming the offending field; nothing touches a database.
    """
    if not _TOPIC.match(envelope.topic) or envelope.topic in {".", ".."}:
        raise InvalidMessage(
            "topic",
            f"{envelope.topic[:80]!r} is not a Kafka topic name: use 1-249 characters of "
            "a-z A-Z 0-9 . _ - (and not '.' or '..')",
        )
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
    if message.size > settings.max_message_bytes:
        raise InvalidMessage(
            "message",
            f"is {message.size} bytes, over settings.max_message_bytes "
            f"({settings.max_message_bytes}): store the bulk as an artifact and send a reference",
        )
    return message


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
        _check_text(f"headers[{name!r}]", name)
        if name in headers or name in _OWN_HEADERS:
            raise InvalidMessage(
                f"headers[{name!r}]", "is set by outboxkit: use the Envelope field instead"
            )
        headers[name] = value
    for name, value in headers.items():
        _check_text(f"headers[{name!r}]", value)
    return headers


def current_trace_headers() -> dict[str, str]:
    """W3C ``traceparent``/``tracestate`` of the active OpenTelemetry span, if any.

    OpenTelemetry is optional: without it installed, or without an active span, this is empty.
    Inside :func:`outbox.emit.emit` the active span is its ``outbox.emit`` span.
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
