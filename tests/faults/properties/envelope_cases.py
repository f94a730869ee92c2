"""Hypothesis strategies for envelope cases: a valid envelope, or one with exactly one fault.

Each case knows its expected outcome, decided by construction (not by re-running the
library's own checks): ``expect`` is ``None`` for a valid envelope, the field
:class:`~outbox.errors.InvalidMessage` must name, or ``"validation:<field>"`` when building
the :class:`~outbox.messages.envelope.Envelope` itself must fail (wrong types are "checked when
built": InvalidMessage too, with pydantic's ``ValidationError`` as its cause).
"""

from __future__ import annotations

import decimal
import math
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hypothesis import strategies as st

from outbox.messages.envelope import MAX_PAYLOAD_DEPTH
from outbox.settings import OutboxSettings

ORDERED = "orders"
SETTINGS = OutboxSettings(max_message_bytes=4096, ordered_topics=frozenset({ORDERED}))
"""A small configured limit, so "over max_message_bytes" costs kilobytes, not megabytes."""

RESERVED_HEADERS = (
    "message-id",
    "message-type",
    "created-at",
    "correlation-id",
    "causation-id",
    "run-id",
    "workflow-version",
    "schema-version",
)
OPTIONAL_HEADER_FIELDS = {
    "correlation_id": "correlation-id",
    "causation_id": "causation-id",
    "workflow_version": "workflow-version",
    "schema_version": "schema-version",
}

# Text PostgreSQL and UTF-8 accept: no NUL, no lone surrogate.
clean_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
# Extra header names the caller may set (traceparent/tracestate may be set, but then no
# active span's context is added: left out to keep the expected headers simple).
header_name = clean_text.filter(
    lambda s: s not in RESERVED_HEADERS and s not in {"traceparent", "tracestate"}
)
topic_chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
valid_topic = st.one_of(
    st.text(st.sampled_from(topic_chars), min_size=1, max_size=40),
    st.just("x" * 249),
).filter(lambda t: t not in {".", ".."})

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    clean_text,
)
valid_json = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(clean_text, inner, max_size=4),
    max_leaves=10,
)


def bad_text(base: str) -> st.SearchStrategy[str]:
    """*base* with a NUL or a lone surrogate inserted somewhere."""
    return st.tuples(
        st.integers(0, len(base)), st.sampled_from(["\x00", "\ud800", "\udfff", "\udc80"])
    ).map(lambda t: base[: t[0]] + t[1] + base[t[0] :])


any_bad_text = clean_text.flatmap(bad_text)
invalid_topic = st.one_of(
    st.sampled_from(["", ".", "..", "x" * 250, "a b", "a/b", "naïve", "t\x00", "t\ud800"]),
    st.text(max_size=20).filter(
        lambda t: t in {"", ".", ".."} or any(c not in topic_chars for c in t)
    ),
    st.integers(250, 400).map(lambda n: "t" * n),
)


@dataclass
class Case:
    """Keyword arguments for ``Envelope(...)``, whether to emit with the lease, and the
    outcome: ``None`` (valid), the InvalidMessage field, or ``validation:<field>``."""

    fields: dict[str, Any]
    expect: str | None
    with_lease: bool = False


def _keyed_if_ordered(fields: dict[str, Any]) -> dict[str, Any]:
    if fields["topic"] == ORDERED and fields.get("key") is None:
        fields["key"] = "k"
    return fields


BASE = st.tuples(
    st.fixed_dictionaries(
        {"topic": valid_topic, "type": clean_text.filter(bool), "payload": valid_json}
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "key": st.one_of(st.none(), clean_text, st.binary(max_size=16)),
            "correlation_id": clean_text,
            "causation_id": clean_text,
            "workflow_version": clean_text,
            "schema_version": clean_text,
            "headers": st.dictionaries(header_name, clean_text, max_size=3),
            "run_id": st.uuids(),
        },
    ),
).map(lambda t: _keyed_if_ordered({**t[0], **t[1]}))
"""The fields of a valid envelope."""


# --- payload faults ---------------------------------------------------------------------
# Each is (bad value, path, located): *located* faults are found by the walk over the payload
# and named by their exact path; the others (not JSON, too deep) name just "payload".

Fault = tuple[Any, str, bool]


class Opaque:
    """An object json.dumps cannot serialise."""


def _not_json() -> st.SearchStrategy[Fault]:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    values = [
        math.nan,
        math.inf,
        -math.inf,
        {1, 2},
        b"bytes",
        Opaque(),
        decimal.Decimal("1.5"),
        datetime(2024, 1, 1, tzinfo=UTC),
        complex(1, 2),
        uuid.UUID(int=7),
        10**5000,  # over Python's int-to-str digit limit
        cyclic,
    ]
    return st.sampled_from(values).map(lambda v: (v, "payload", False))


def _too_deep() -> st.SearchStrategy[Fault]:
    def nest(depth: int) -> Any:
        value: Any = "leaf"
        for level in range(depth):
            value = [value] if level % 2 else {"d": value}
        return value

    return st.integers(MAX_PAYLOAD_DEPTH + 1, 3000).map(lambda d: (nest(d), "payload", False))


def _bad_text_in_payload() -> st.SearchStrategy[Fault]:
    as_value = any_bad_text.map(lambda s: (s, "payload", True))
    as_key = st.tuples(any_bad_text, valid_json).map(
        lambda t: ({t[0]: t[1]}, f"payload.<key {t[0][:40]!r}>", True)
    )
    return st.one_of(as_value, as_key)


def _non_str_key() -> st.SearchStrategy[Fault]:
    # json.dumps would turn 1 into "1" (and {1: a, "1": b} into a duplicate key): refused.
    keys = st.one_of(st.integers(-5, 5), st.none(), st.booleans(), st.floats(allow_nan=False))
    return st.tuples(keys, valid_json).map(
        lambda t: ({t[0]: t[1]}, f"payload.<key {t[0]!r}>", True)
    )


def _wrapped(bad: st.SearchStrategy[Fault]) -> st.SearchStrategy[Fault]:
    """Put a bad value somewhere inside a valid payload; a located path follows it."""

    def wrap(inner: Fault, steps: list[tuple[str, Any]]) -> Fault:
        value, path, located = inner
        suffix = path[len("payload") :]
        for kind, extra in reversed(steps):
            if kind == "list":
                value = [*extra, value]
                suffix = f"[{len(extra)}]" + suffix
            else:
                value = {**extra, "k": value}
                suffix = ".k" + suffix
        return value, ("payload" + suffix if located else "payload"), located

    step = st.one_of(
        st.tuples(st.just("list"), st.lists(valid_json, max_size=2)),
        st.tuples(
            st.just("dict"),
            st.dictionaries(clean_text.filter(lambda k: k != "k"), valid_json, max_size=2),
        ),
    )
    return st.builds(wrap, bad, st.lists(step, max_size=3))


# --- whole cases ---------------------------------------------------------------------------
# A fault is (changes to the valid fields, the expected outcome, a field to leave out). Each
# kind of fault gets its own test run (see KINDS): a one_of over all of them would let
# hypothesis spend most examples on its first, simplest branch.

Change = tuple[dict[str, Any], str, str | None]


def _change(changes: dict[str, Any], expect: str, drop: str | None = None) -> Change:
    return changes, expect, drop


def _payload(fault: st.SearchStrategy[Fault]) -> st.SearchStrategy[Change]:
    return _wrapped(fault).map(lambda p: _change({"payload": p[0]}, p[1]))


_not_text = st.one_of(
    st.integers(), st.floats(), st.lists(st.integers(), max_size=2), st.just({"a": 1})
)
_WRONG_TYPES: dict[str, st.SearchStrategy[Any]] = {
    "topic": st.one_of(_not_text, st.none()),
    "type": st.one_of(_not_text, st.none()),
    "key": st.one_of(st.integers(), st.floats(), st.just(["k"]), st.just({"k": 1})),
    "message_id": st.one_of(
        st.integers(), st.text(max_size=20).filter(lambda s: not _uuid_like(s))
    ),
    "run_id": st.one_of(st.floats(), st.just("run-7"), st.just([1])),
    "correlation_id": _not_text,
    "headers": st.one_of(
        st.just(["a"]),
        st.just("a=b"),
        st.dictionaries(clean_text, st.integers(), min_size=1, max_size=2),
        st.dictionaries(st.integers(), clean_text, min_size=1, max_size=2),
    ),
    "created_at": st.one_of(st.just("yesterday"), st.just([2024])),
    "priority": st.integers(),  # no such field (extra="forbid")
}
"""Values pydantic refuses for each field: building the Envelope fails (InvalidMessage)."""

FAULTS: dict[str, st.SearchStrategy[Change]] = {
    "topic": invalid_topic.map(lambda t: _change({"topic": t}, "topic")),
    "type": st.one_of(st.just(""), any_bad_text).map(lambda t: _change({"type": t}, "type")),
    "key": any_bad_text.map(lambda k: _change({"key": k}, "key")),
    "ordered-without-key": st.just(_change({"topic": ORDERED, "key": None}, "key")),
    "payload-not-json": _payload(_not_json()),
    "payload-too-deep": _payload(_too_deep()),
    "payload-text": _payload(_bad_text_in_payload()),
    "payload-key-type": _payload(_non_str_key()),
    "header-field": st.tuples(st.sampled_from(sorted(OPTIONAL_HEADER_FIELDS)), any_bad_text).map(
        lambda t: _change({t[0]: t[1]}, f"headers[{OPTIONAL_HEADER_FIELDS[t[0]]!r}]")
    ),
    "header-name": st.tuples(any_bad_text, clean_text).map(
        lambda t: _change({"headers": {t[0]: t[1]}}, f"headers[{t[0]!r}]")
    ),
    "header-value": st.tuples(header_name, any_bad_text).map(
        lambda t: _change({"headers": {t[0]: t[1]}}, f"headers[{t[0]!r}]")
    ),
    "own-header": st.sampled_from(RESERVED_HEADERS).map(
        lambda n: _change({"headers": {n: "forged"}}, f"headers[{n!r}]")
    ),
    "size": st.one_of(
        st.integers(0, 20_000).map(
            lambda extra: _change(
                {"payload": {"pad": "x" * (SETTINGS.max_message_bytes + extra)}}, "message"
            )
        ),
        # counted in UTF-8 bytes, not characters
        st.just(_change({"payload": "é" * (SETTINGS.max_message_bytes // 2 + 1)}, "message")),
        st.integers(1, 50).map(
            lambda n: _change({"key": b"k" * (SETTINGS.max_message_bytes + n)}, "message")
        ),
    ),
    "run-id-not-the-lease's": st.just(_change({"run_id": uuid.UUID(int=1)}, "run_id")),
    "wrong-type": st.one_of(
        *(
            strategy.map(lambda v, name=name: _change({name: v}, f"validation:{name}"))
            for name, strategy in _WRONG_TYPES.items()
        )
    ),
    "missing-field": st.sampled_from(["topic", "type", "payload"]).map(
        lambda name: _change({}, f"validation:{name}", drop=name)
    ),
}
"""Every kind of fault, by name. "run-id-not-the-lease's" is a fault only with a lease."""

NEEDS_LEASE = frozenset({"run-id-not-the-lease's"})
UNBUILDABLE = frozenset({"wrong-type", "missing-field"})


def _uuid_like(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


@st.composite
def cases(draw: st.DrawFn, kind: str | None, *, with_lease: bool) -> Case:
    """A valid envelope (*kind* None), or one with a fault of *kind*."""
    fields = draw(BASE)
    if with_lease:
        fields.pop("run_id", None)  # emit fills it in from the lease (another id is a fault)
    if kind is None:
        return Case(fields, None, with_lease=with_lease)
    changes, expect, drop = draw(FAULTS[kind])
    fields = {**fields, **changes}
    if drop is not None:
        fields.pop(drop, None)
    return Case(fields, expect, with_lease=with_lease)


@st.composite
def emits(draw: st.DrawFn, kind: str | None) -> tuple[bool, list[Case]]:
    """One call of ``emit``: a case of *kind* (None: valid), with or without the lease."""
    with_lease = kind in NEEDS_LEASE or draw(st.booleans())
    return with_lease, [draw(cases(kind, with_lease=with_lease))]


@st.composite
def batches(draw: st.DrawFn) -> tuple[bool, list[Case]]:
    """One call of ``emit_many``: 2-5 buildable cases, mostly valid, any fault kinds."""
    with_lease = draw(st.booleans())
    kinds = sorted(k for k in FAULTS if k not in UNBUILDABLE | NEEDS_LEASE)
    if with_lease:
        kinds.append(next(iter(NEEDS_LEASE)))
    members = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(kinds))
    chosen = draw(st.lists(members, min_size=2, max_size=5))
    return with_lease, [draw(cases(kind, with_lease=with_lease)) for kind in chosen]
