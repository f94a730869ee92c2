"""Envelope validation: every rule names the field, and valid messages encode exactly."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import envelope as envelope_module
from outbox.envelope import MAX_PAYLOAD_DEPTH, Envelope, encode
from outbox.errors import InvalidMessage
from outbox.lanes import lane_for, ordering_lock_key
from outbox.settings import OutboxSettings

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
        just_fits = encode(make(payload="x"), SETTINGS)
        room = SETTINGS.max_message_bytes - just_fits.size
        assert encode(make(payload="x", headers={"pad": "y" * (room - 3)}), SETTINGS)
        assert rejected_field(make(payload="x", headers={"pad": "y" * (room - 2)})) == "message"

    def test_missing_key_on_an_ordered_topic(self) -> None:
        assert rejected_field(make(topic="orders", key=None)) == "key"
        assert encode(make(topic="orders", key="o-1"), SETTINGS).key == b"o-1"

    def test_empty_type(self) -> None:
        assert rejected_field(make(type="")) == "type"


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
