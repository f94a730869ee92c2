"""Envelope validation: every rule names the field, and valid messages encode exactly."""

from __future__ import annotations

import base64
import json
import math
import random
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatchBuilder
from pydantic import ValidationError

from outbox.errors import InvalidMessage, OutboxError
from outbox.messages import envelope as envelope_module
from outbox.messages.envelope import (
    COMPRESSION_ROOM_FIXED,
    COMPRESSION_ROOM_PER_16_KIB,
    MAX_PAYLOAD_DEPTH,
    EncodedMessage,
    Envelope,
    encode,
)
from outbox.messages.lanes import lane_for, ordering_lock_key
from outbox.settings import OutboxSettings
from relay.claims import OutboxRow
from relay.publisher import kafka_headers

SETTINGS = OutboxSettings(max_message_bytes=4096, ordered_topics=frozenset({"orders"}))


def make(**fields: Any) -> Envelope:
    values: dict[str, Any] = {"topic": "events", "type": "thing.happened", "payload": {"a": 1}}
    values.update(fields)
    return Envelope(**values)


def nested(depth: int) -> Any:
    """*depth* lists and objects inside one another."""
    value: Any = 0
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def rejected_field(envelope: Envelope, settings: OutboxSettings = SETTINGS) -> str:
    with pytest.raises(InvalidMessage) as caught:
        encode(envelope, settings)
    return caught.value.field


class TestRejections:
    @pytest.mark.parametrize("topic", ["", ".", "..", "a b", "naïve", "x" * 250, "a/b", "t\x00"])
    def test_topic_that_kafka_would_refuse(self, topic: str) -> None:
        assert rejected_field(make(topic=topic)) == "topic"

    @pytest.mark.parametrize("topic", ["a", "A-b_c.d", "x" * 249, "..."])
    def test_topic_that_kafka_accepts(self, topic: str) -> None:
        assert encode(make(topic=topic), SETTINGS).topic == topic

    def test_payload_that_is_not_json(self) -> None:
        assert rejected_field(make(payload={"when": {1, 2}})) == "payload"

    def test_payload_with_nan(self) -> None:
        assert rejected_field(make(payload={"x": math.nan})) == "payload"

    def test_payload_with_a_cycle(self) -> None:
        cyclic: list[Any] = []
        cyclic.append(cyclic)
        assert rejected_field(make(payload=cyclic)) == "payload"

    def test_nul_in_a_nested_payload_string_names_its_path(self) -> None:
        assert rejected_field(make(payload={"items": [{"name": "a\x00b"}]})) == (
            "payload.items[0].name"
        )

    def test_nul_in_a_payload_object_key(self) -> None:
        assert rejected_field(make(payload={"a\x00": 1})).startswith("payload.<key")

    def test_lone_surrogate_in_payload(self) -> None:
        assert rejected_field(make(payload=["ok", "bad \udc80"])) == "payload[1]"

    def test_nul_in_a_str_key(self) -> None:
        assert rejected_field(make(key="k\x00")) == "key"

    def test_lone_surrogate_in_a_str_key(self) -> None:
        assert rejected_field(make(key="\ud800")) == "key"

    def test_nul_in_a_bytes_key_is_fine_binary_data(self) -> None:
        assert encode(make(key=b"\x00\xff"), SETTINGS).key == b"\x00\xff"

    def test_a_str_key_and_its_utf8_bytes_are_the_same_key(self) -> None:
        text, raw = encode(make(key="café"), SETTINGS), encode(make(key="café".encode()), SETTINGS)
        assert text.key == raw.key == "café".encode()
        assert ordering_lock_key(text.topic, text.key) == ordering_lock_key(raw.topic, raw.key)
        assert lane_for(text.key, text.message_id, 64) == lane_for(raw.key, raw.message_id, 64)

    def test_nul_in_a_header_value(self) -> None:
        assert rejected_field(make(correlation_id="c\x00")) == "headers['correlation-id']"

    def test_lone_surrogate_in_an_extra_header(self) -> None:
        assert rejected_field(make(headers={"tenant": "\udfff"})) == "headers['tenant']"

    def test_extra_header_cannot_override_an_outboxkit_header(self) -> None:
        assert rejected_field(make(headers={"message-id": "forged"})) == "headers['message-id']"

    @pytest.mark.parametrize(
        "name",
        ["message-id", "message-type", "created-at", "correlation-id", "causation-id", "run-id",
         "workflow-version", "schema-version"],
    )
    def test_an_outboxkit_header_name_is_refused_even_when_its_field_is_unset(
        self, name: str
    ) -> None:
        # Regression (issue #6): with run_id unset, headers={"run-id": ...} went through, and
        # a consumer's ctx.confirm would then have moved whatever run that header named.
        assert rejected_field(make(headers={name: "forged"})) == f"headers[{name!r}]"

    @pytest.mark.parametrize("payload", [{1: "a"}, {"x": [{None: 1}]}, {1: "a", "1": "b"}])
    def test_a_payload_object_key_that_is_not_a_string_is_refused(self, payload: Any) -> None:
        # Regression (issue #6): json.dumps turned 1 into "1" silently, so the stored payload
        # differed from the one given ({1: "a", "1": "b"} even became a duplicate key).
        assert "<key" in rejected_field(make(payload=payload))

    def test_nesting_up_to_the_bound_is_accepted(self) -> None:
        assert encode(make(payload=nested(MAX_PAYLOAD_DEPTH)), SETTINGS)

    @pytest.mark.parametrize("depth", [MAX_PAYLOAD_DEPTH + 1, *range(950, 1001), 50_000])
    def test_nesting_past_the_bound_is_refused_never_a_recursion_error(self, depth: int) -> None:
        # Regression (issue #6): just under Python's recursion limit json.dumps succeeded and
        # the walk that names bad text then raised a bare RecursionError.
        assert rejected_field(make(payload=nested(depth))) == "payload"

    def test_message_over_the_size_limit(self) -> None:
        assert rejected_field(make(payload="x" * 5000)) == "message"

    def test_size_counts_key_and_headers_too(self) -> None:
        bare = encode(make(payload="x"), SETTINGS).size
        # A header costs its name and its value, each after its varint length (1 and 2 bytes).
        room = SETTINGS.max_message_bytes - bare - (1 + len("pad")) - 2
        assert encode(make(payload="x", headers={"pad": "y" * room}), SETTINGS).size == (
            SETTINGS.max_message_bytes
        )
        assert rejected_field(make(payload="x", headers={"pad": "y" * (room + 1)})) == "message"
        # No key is one byte (-1); a 10-byte key is its varint length and itself.
        assert encode(make(payload="x", key="k" * 10), SETTINGS).size == bare - 1 + 1 + 10

    def test_the_size_error_says_the_limit_and_how_big_the_message_is(self) -> None:
        envelope = make(payload="x" * 5000)
        with pytest.raises(InvalidMessage) as caught:
            encode(envelope, SETTINGS)
        size = encode(envelope, OutboxSettings()).size
        assert f"is {size} bytes as a Kafka record (payload 5002" in str(caught.value)
        assert f"over settings.max_message_bytes ({SETTINGS.max_message_bytes})" in str(
            caught.value
        )

    def test_missing_key_on_an_ordered_topic(self) -> None:
        assert rejected_field(make(topic="orders", key=None)) == "key"
        assert encode(make(topic="orders", key="o-1"), SETTINGS).key == b"o-1"

    def test_empty_type(self) -> None:
        assert rejected_field(make(type="")) == "type"


CLEAN = st.characters(codec="utf-8", exclude_characters="\x00")  # what emit accepts
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CODECS = {"gzip": 1, "lz4": 3}  # kafka-python's codec ids; the ones installed here


def relay_record(message: EncodedMessage, traceparent: str = TRACEPARENT) -> list[Any]:
    """The record the relay sends for *message*: its key, value and headers, with the
    traceparent a tracing relay puts on it (its own publish span's)."""
    row = OutboxRow(1, message.message_id, message.topic, message.key, message.type,
                    message.payload, message.headers, datetime.now(UTC), 0, 0)
    headers = [(n, v) for n, v in kafka_headers(row) if n not in {"traceparent", "tracestate"}]
    headers += [("traceparent", traceparent.encode())]
    headers += [("tracestate", v.encode()) for n, v in message.headers.items()
                if n == "tracestate"]
    return [message.key, message.payload, headers]



class TestKafkaRecordSize:
    """Issue #13: emit accepted 1,048,464 base64 characters that the relay's producer then
    refused ("1048669 bytes when serialized"): emit must count what the producer counts."""

    @settings(max_examples=200, deadline=None)
    @given(
        key=st.none() | st.binary(max_size=300),
        payload=st.text(CLEAN, max_size=300),
        headers=st.dictionaries(
            st.text(CLEAN, min_size=1, max_size=20).filter(
                lambda n: n not in envelope_module._OWN_HEADERS | {"traceparent", "tracestate"}
            ),
            st.text(CLEAN, max_size=200),
            max_size=70,  # past 63 headers their count takes two varint bytes
        ),
        traced=st.booleans(),
    )
    def test_size_is_what_kafka_pythons_producer_estimates_plus_compression_room(
        self, key: bytes | None, payload: str, headers: dict[str, str], traced: bool
    ) -> None:
        if traced:
            headers = {**headers, "traceparent": TRACEPARENT, "tracestate": "a=1,b=2"}
        message = encode(make(key=key, payload=payload, headers=headers), ROOMY)
        estimate = DefaultRecordBatchBuilder.estimate_size_in_bytes(*relay_record(message))
        blocks = -(-estimate // 16_384)
        assert message.size == estimate + COMPRESSION_ROOM_FIXED + (
            COMPRESSION_ROOM_PER_16_KIB * blocks
        )

    def test_an_untraced_message_keeps_room_for_a_tracing_relays_traceparent(self) -> None:
        plain = encode(make(), ROOMY)
        traced = encode(make(headers={"traceparent": TRACEPARENT}), ROOMY)
        assert plain.size == traced.size

    @pytest.mark.parametrize("codec", sorted(CODECS))
    def test_the_largest_message_emit_accepts_fits_the_producer_and_the_broker(
        self, codec: str
    ) -> None:
        """With the defaults (1 MiB), under any codec, even when compression cannot shrink it."""
        limit = OutboxSettings().max_message_bytes
        message = largest_accepted(OutboxSettings())
        assert message.size == limit
        key, payload, headers = relay_record(message)
        # Incompressible bytes of the same length (what the rule counts is lengths).
        payload = random.Random(13).randbytes(len(payload))
        assert DefaultRecordBatchBuilder.estimate_size_in_bytes(key, payload, headers) <= (
            limit  # the relay's producer: max_request_bytes, 1 MiB by default
        )
        builder = DefaultRecordBatchBuilder(
            magic=2, compression_type=CODECS[codec], is_transactional=False,
            producer_id=1, producer_epoch=0, base_sequence=0, batch_size=262_144,
        )
        builder.append(0, timestamp=None, key=key, value=payload, headers=headers)
        batch = builder.build()
        assert len(batch) <= limit + 12  # the broker's message.max.bytes default: 1048588


def largest_accepted(settings: OutboxSettings) -> EncodedMessage:
    """The message with the longest payload encode accepts under *settings*."""
    blob = base64.b64encode(random.Random(6).randbytes(settings.max_message_bytes)).decode()

    def envelope(length: int) -> Envelope:
        return make(key="supplier-acme", payload=blob[:length], run_id=uuid.UUID(int=7),
                    message_id=uuid.UUID(int=8), correlation_id="corr-1")

    low, high = 0, settings.max_message_bytes
    while low < high:
        middle = (low + high + 1) // 2
        try:
            encode(envelope(middle), settings)
        except InvalidMessage:
            high = middle - 1
        else:
            low = middle
    with pytest.raises(InvalidMessage):
        encode(envelope(low + 1), settings)
    return encode(envelope(low), settings)


class TestOneErrorType:
    """Issue #13: a wrong type raised pydantic's ValidationError at ``Envelope(...)``, a bad
    value InvalidMessage at emit; one type now, naming the field, the cause kept."""

    @pytest.mark.parametrize(
        ("fields", "field", "says"),
        [
            ({"headers": {"tenant": 1}}, "headers['tenant']", "should be a valid string (got int)"),
            ({"headers": {7: "x"}}, "headers[7]", "should be a valid string (got int)"),
            ({"key": 5}, "key", "valid string or should be a valid bytes (got int)"),
            ({"run_id": "run-7"}, "run_id", "UUID"),
            ({"priority": 1}, "priority", "is not a field of Envelope (the fields are topic,"),
            ({"topic": None, "type": [1]}, "topic", "(also invalid: type)"),
        ],
    )
    def test_a_wrong_type_is_an_invalid_message_naming_the_field(
        self, fields: dict[str, Any], field: str, says: str
    ) -> None:
        with pytest.raises(InvalidMessage) as caught:
            make(**fields)
        assert caught.value.field == field
        assert says in str(caught.value)
        assert isinstance(caught.value, OutboxError)
        assert isinstance(caught.value.__cause__, ValidationError)  # every error, for tools

    def test_a_missing_field_is_an_invalid_message(self) -> None:
        with pytest.raises(InvalidMessage) as caught:
            Envelope(type="t", payload={})  # type: ignore[call-arg]
        assert (caught.value.field, caught.value.reason) == ("topic", "is required")

    def test_model_validate_refuses_with_the_same_type(self) -> None:
        with pytest.raises(InvalidMessage) as caught:
            Envelope.model_validate({"topic": "t", "type": "t", "payload": 1, "key": 1.5})
        assert caught.value.field == "key"

    def test_the_value_itself_is_not_quoted(self) -> None:
        with pytest.raises(InvalidMessage) as caught:
            make(correlation_id=["secret-token"] * 10_000)
        assert "secret-token" not in str(caught.value)
        assert len(str(caught.value)) < 200

    def test_a_long_topic_name_is_shown_by_its_length_not_in_full(self) -> None:
        with pytest.raises(InvalidMessage) as caught:
            encode(make(topic="t" * 10_000), SETTINGS)
        assert "(10000 characters) is too long" in str(caught.value)
        assert len(str(caught.value)) < 200

    def test_a_topic_with_a_bad_character_says_which_and_where(self) -> None:
        with pytest.raises(InvalidMessage) as caught:
            encode(make(topic="orders/eu"), SETTINGS)
        assert "'orders/eu' has '/' at offset 6" in str(caught.value)

    def test_a_long_header_name_is_shown_by_its_length_not_in_full(self) -> None:
        with pytest.raises(InvalidMessage) as caught:
            encode(make(headers={"h" * 10_000: "a\x00"}), SETTINGS)
        assert "(10000 characters)" in caught.value.field
        assert len(str(caught.value)) < 200


class TestEncoding:
    def test_payload_is_compact_utf8_json_in_key_order(self) -> None:
        message = encode(make(payload={"z": 1, "a": "é", "m": [1, 2]}), SETTINGS)
        assert message.payload == '{"z":1,"a":"é","m":[1,2]}'.encode()

    def test_headers_carry_ids_and_versions(self) -> None:
        run_id = uuid.uuid4()
        envelope = make(
            correlation_id="corr",
            causation_id="cause",
            run_id=run_id,
            workflow_version="wf-3",
            schema_version="2",
            headers={"tenant": "t1"},
        )
        headers = encode(envelope, SETTINGS).headers
        assert headers["message-id"] == str(envelope.message_id)
        assert headers["message-type"] == "thing.happened"
        assert headers["correlation-id"] == "corr"
        assert headers["causation-id"] == "cause"
        assert headers["run-id"] == str(run_id)
        assert headers["workflow-version"] == "wf-3"
        assert headers["schema-version"] == "2"
        assert headers["tenant"] == "t1"
        assert "traceparent" not in headers

    def test_message_id_is_stable_across_encodes(self) -> None:
        envelope = make()
        assert encode(envelope, SETTINGS).message_id == encode(envelope, SETTINGS).message_id
        assert make().message_id != envelope.message_id

    def test_traceparent_is_added_when_opentelemetry_has_an_active_span(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        monkeypatch.setattr(
            envelope_module.tracing, "trace_headers", lambda: {"traceparent": traceparent}
        )
        headers = encode(make(), SETTINGS).headers
        assert headers["traceparent"] == traceparent

    def test_a_traceparent_set_explicitly_wins_over_the_active_span(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        active = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        carried = "00-11111111111111111111111111111111-2222222222222222-01"
        monkeypatch.setattr(
            envelope_module.tracing,
            "trace_headers",
            lambda: {"traceparent": active, "tracestate": "a=1"},
        )
        headers = encode(make(headers={"traceparent": carried}), SETTINGS).headers
        assert headers["traceparent"] == carried
        assert "tracestate" not in headers


class TestLanes:
    def test_same_key_same_lane_across_messages(self) -> None:
        lanes = {lane_for(b"customer-7", uuid.uuid4(), 64) for _ in range(20)}
        assert len(lanes) == 1

    def test_lane_is_stable_across_processes(self) -> None:
        # A fixed value: if the hash ever changed, pending rows would move lanes.
        assert lane_for(b"customer-7", uuid.UUID(int=0), 64) == lane_for(
            b"customer-7", uuid.UUID(int=1), 64
        )
        assert 0 <= lane_for(None, uuid.UUID(int=5), 64) < 64

    def test_keyless_messages_spread_over_lanes(self) -> None:
        assert len({lane_for(None, uuid.uuid4(), 8) for _ in range(200)}) == 8

    def test_ordering_lock_depends_on_topic_and_key(self) -> None:
        assert ordering_lock_key("t", None) is None
        assert ordering_lock_key("t", b"k") == ordering_lock_key("t", b"k")
        assert ordering_lock_key("t", b"k") != ordering_lock_key("u", b"k")
        assert ordering_lock_key("ab", b"c") != ordering_lock_key("a", b"bc")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _text_is_clean(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return all(_text_is_clean(k) and _text_is_clean(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_text_is_clean(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return True


# Roomy enough that size never decides: the property is about the content rules.
ROOMY = OutboxSettings(ordered_topics=frozenset({"orders"}))


class TestProperties:
    @settings(max_examples=200, deadline=None)
    @given(
        topic=st.text(min_size=0, max_size=260),
        key=st.none() | st.text(max_size=20) | st.binary(max_size=20),
        payload=_json,
    )
    def test_encode_accepts_exactly_the_valid_messages_and_round_trips_them(
        self, topic: str, key: str | bytes | None, payload: Any
    ) -> None:
        envelope = Envelope(topic=topic, type="t", key=key, payload=payload)
        topic_ok = (
            0 < len(topic) < 250
            and topic not in {".", ".."}
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in topic)
        )
        key_ok = not isinstance(key, str) or _text_is_clean(key)
        ordered_ok = key is not None or topic not in ROOMY.ordered_topics
        valid = topic_ok and key_ok and ordered_ok and _text_is_clean(payload)
        if not valid:
            with pytest.raises(InvalidMessage) as caught:
                encode(envelope, ROOMY)
            assert caught.value.field
            assert caught.value.reason
            return
        message = encode(envelope, ROOMY)
        assert json.loads(message.payload) == payload
        assert message.size <= ROOMY.max_message_bytes
        assert message.key == (key.encode() if isinstance(key, str) else key)
