"""call_digest: one exact call, one digest, whatever the key order; what JSON cannot carry
exactly is refused, naming the argument."""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from outbox import call_digest
from outbox.errors import ConfigurationError
from outbox.runs.approvals import request_plan


def test_the_digest_is_sha256_of_the_canonical_json_of_tool_and_args() -> None:
    canonical = '{"args":{"item":"ünïcode ✓","qty":3},"tool":"reorder"}'
    expected = "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    assert call_digest("reorder", {"qty": 3, "item": "ünïcode ✓"}) == expected


def test_key_order_does_not_matter_at_any_depth() -> None:
    one = call_digest("pay", {"to": {"iban": "X", "name": "Ann"}, "amount": 10, "tags": ["a"]})
    other = call_digest("pay", {"amount": 10, "tags": ["a"], "to": {"name": "Ann", "iban": "X"}})
    assert one == other


@pytest.mark.parametrize(("tool", "args"), [
    ("pay", {"amount": 11}),          # another value
    ("refund", {"amount": 10}),       # another tool
    ("pay", {"amount": 10.0}),        # a float is not the integer
    ("pay", {"amount": "10"}),        # nor the text
    ("pay", {"amount": 10, "to": None}),  # an argument more
    ("pay", {"amount": [10]}),        # order and nesting count
])
def test_any_other_call_has_another_digest(tool: str, args: dict[str, Any]) -> None:
    assert call_digest(tool, args) != call_digest("pay", {"amount": 10})


def test_text_is_hashed_as_utf8_not_as_escapes() -> None:
    # ensure_ascii=False: "é" is two UTF-8 bytes in the hashed text, not "\\u00e9".
    canonical = '{"args":{"name":"é"},"tool":"t"}'
    assert call_digest("t", {"name": "é"}) == (
        "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest())


@pytest.mark.parametrize(("args", "named"), [
    ({"amount": math.nan}, "argument 'amount' of tool 'pay' is nan"),
    ({"amount": math.inf}, "argument 'amount' of tool 'pay' is inf"),
    ({"to": {"limits": [1, -math.inf]}}, "argument 'to' of tool 'pay'['limits'][1] is -inf"),
    ({"when": datetime(2030, 1, 1, tzinfo=UTC)}, "argument 'when' of tool 'pay' is a datetime"),
    ({"amount": Decimal("1.5")}, "argument 'amount' of tool 'pay' is a Decimal"),
    ({"to": {1: "a"}}, "argument 'to' of tool 'pay' has the key 1"),
    ({2: "a"}, "tool 'pay' has an argument named 2"),
])
def test_what_json_cannot_carry_exactly_is_refused_naming_the_argument(
        args: dict[Any, Any], named: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        call_digest("pay", args)
    assert named in str(refused.value)


def test_a_tool_without_a_name_or_arguments_that_are_not_an_object_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="non-empty name"):
        call_digest("", {})
    with pytest.raises(ConfigurationError, match="are a JSON object"):
        call_digest("pay", [1, 2])  # type: ignore[arg-type]


def test_a_bound_request_must_show_the_call_its_digest_binds() -> None:
    """The person approves what the scope shows; the run spends the digest: they must agree
    (refused before any SQL is sent)."""
    digest = call_digest("pay", {"amount": 10})
    with pytest.raises(ConfigurationError, match="not that of the call the scope shows"):
        next(request_plan(None, {"tool": "pay", "args": {"amount": 11}},  # type: ignore[arg-type]
                          datetime(2030, 1, 1, tzinfo=UTC), None, digest))
    with pytest.raises(ConfigurationError, match="its scope is"):
        next(request_plan(None, {"tool": "pay", "max": 10},  # type: ignore[arg-type]
                          datetime(2030, 1, 1, tzinfo=UTC), None, digest))
    with pytest.raises(ConfigurationError, match="is not a call digest"):
        next(request_plan(None, {"tool": "pay", "args": {}},  # type: ignore[arg-type]
                          datetime(2030, 1, 1, tzinfo=UTC), None, "sha256:XYZ"))
