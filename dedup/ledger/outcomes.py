"""What an outside system told us, as small typed values.

A call answers :class:`Applied` (the system took it), :class:`Refused` (a definite no) or
:class:`Unclear` (timeout, dropped connection, 5xx: it may or may not have been applied).
A status query answers :class:`Found`, :class:`NotFound` (definitely not there: safe to call
again with the same key) or :class:`Unclear` (the status endpoint could not say). Only
``Applied``/``Refused``/``Found`` carry :class:`Evidence`; the ledger never invents it.

Evidence is kept small: a response is kept as its digest, and :func:`clip` cuts any value
over a byte limit down to its head plus its full size and sha256, so a 1 MB error page can
neither bloat a row nor be altered silently.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import ConfigurationError

DEFAULT_MAX_VALUE_BYTES = 4096
"""The default limit of one evidence value (a response body, an error text), in bytes."""
MIN_MAX_VALUE_BYTES = 256
"""Smaller limits could not hold the truncation note (size and sha256) itself."""


def canonical_json(value: Any) -> str:
    """*value* as canonical JSON (sorted keys, no spaces, non-ASCII kept as is)."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"the request/response must be JSON (dicts, lists, str, numbers, bool, None): {exc}"
        ) from exc


def canonical_digest(value: Any) -> str:
    """``sha256:<hex>`` of *value* as canonical JSON (sorted keys, no spaces, UTF-8).

    Two requests that are equal as JSON have the same digest whatever their key order.
    """
    return "sha256:" + hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def clip(value: Any, max_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> Any:
    """*value* unchanged if it fits in *max_bytes*; else its head and a truncation note.

    A string is measured as its UTF-8 bytes, a list or object as its canonical JSON; numbers,
    booleans and None are always kept. An oversized value becomes one string of at most
    *max_bytes* bytes: the head of its text, then ``… [truncated: N bytes in all,
    sha256:<hex>]`` where the sha256 is of the **full** text (the string's UTF-8, or the
    canonical JSON, i.e. :func:`canonical_digest`), so the original can still be matched.
    """
    if max_bytes < MIN_MAX_VALUE_BYTES:
        raise ConfigurationError(f"a value limit must be >= {MIN_MAX_VALUE_BYTES} bytes "
                                 f"(room for the truncation note), got {max_bytes}")
    if isinstance(value, str):
        text = value
    elif isinstance(value, Mapping | list | tuple):
        text = canonical_json(value)
    else:
        return value
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return value
    note = f"… [truncated: {len(data)} bytes in all, sha256:{hashlib.sha256(data).hexdigest()}]"
    room = max_bytes - len(note.encode("utf-8"))
    # "ignore" drops a character cut in half at the end, so the head stays valid UTF-8.
    return data[:room].decode("utf-8", "ignore") + note


def clip_detail(detail: Any, max_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> Any:
    """An event's or evidence's *detail* with each value clipped (:func:`clip`).

    An object keeps its keys (so ``http_status`` stays readable next to a clipped ``body``);
    anything else is clipped as a whole.
    """
    if isinstance(detail, Mapping):
        return {key: clip(value, max_bytes) for key, value in detail.items()}
    return clip(detail, max_bytes)


def bound_events(
    events: Sequence[Mapping[str, Any]], *, keep_last: int,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
) -> dict[str, Any]:
    """An operation's events (``OperationEvent.as_json()``, in order) bounded for evidence.

    Kept in full (each detail value clipped to *max_value_bytes*): the first ``intent`` and
    the first ``call`` event — what was asked and what the first call said — and the last
    *keep_last* events. Each run of events between them becomes one entry ``{"elided": n,
    "kinds": {"check/unclear": n}, "from": at, "to": at, "digest": ...}`` where the digest
    is ``canonical_digest`` of those events as they were, so ``operation_history()`` can
    prove what was left out. Returns ``{"events_total", "events_elided", "events"}``.
    """
    if keep_last < 1:
        raise ConfigurationError(f"keep_last must be >= 1, got {keep_last}")
    keep = set(range(max(0, len(events) - keep_last), len(events)))
    for kind in ("intent", "call"):
        first = next((i for i, e in enumerate(events) if e.get("kind") == kind), None)
        if first is not None:
            keep.add(first)
    bounded: list[dict[str, Any]] = []
    elided: list[Mapping[str, Any]] = []
    for index, event in enumerate(events):
        if index not in keep:
            elided.append(event)
            continue
        if elided:
            bounded.append(_elided(elided))
            elided = []
        bounded.append({**event, "detail": clip_detail(event.get("detail"), max_value_bytes)})
    if elided:
        bounded.append(_elided(elided))
    return {"events_total": len(events), "events_elided": len(events) - len(keep),
            "events": bounded}


def _elided(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    kinds = Counter(f"{e.get('kind')}/{e.get('outcome')}" for e in events)
    return {"elided": len(events), "kinds": dict(sorted(kinds.items())),
            "from": events[0].get("at"), "to": events[-1].get("at"),
            "digest": canonical_digest([dict(e) for e in events])}


@dataclass(frozen=True)
class Evidence:
    """What the outside system said that establishes an outcome.

    ``reference`` is its own id for the effect (an order number); ``response_digest`` the
    digest of its response; ``detail`` a few small JSON facts (HTTP status, who confirmed).
    """

    reference: str | None = None
    response_digest: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of_response(
        cls, response: Any, *, reference: str | None = None,
        max_detail_bytes: int = DEFAULT_MAX_VALUE_BYTES, **detail: Any
    ) -> Evidence:
        """Evidence from a JSON *response*: its digest is kept, not the response itself.

        Each *detail* value over *max_detail_bytes* (say, the body's ``error`` text) is
        clipped with its size and sha256 (:func:`clip`): evidence is stored in the ledger
        row and every event, so one huge answer must not be copied in full each time.
        """
        return cls(reference=reference, response_digest=canonical_digest(response),
                   detail=clip_detail(detail, max_detail_bytes))

    @classmethod
    def from_json(cls, raw: str) -> Evidence:
        """What a person typed (``outbox ops resolve --evidence``, the console): a JSON object
        whose ``reference`` and ``response_digest`` are lifted out, the rest kept as detail.
        Raises ValueError naming what is wrong."""
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        reference, digest = value.pop("reference", None), value.pop("response_digest", None)
        return cls(reference=None if reference is None else str(reference),
                   response_digest=None if digest is None else str(digest), detail=value)

    def is_empty(self) -> bool:
        return self.reference is None and self.response_digest is None and not self.detail

    def as_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "response_digest": self.response_digest,
            **dict(self.detail),
        }


@dataclass(frozen=True)
class Applied:
    """The call was applied by the outside system."""

    evidence: Evidence


@dataclass(frozen=True)
class Refused:
    """The outside system definitely refused the call (e.g. a 4xx): nothing was applied."""

    evidence: Evidence


@dataclass(frozen=True)
class Found:
    """The status query found the effect: it was applied."""

    evidence: Evidence


@dataclass(frozen=True)
class NotFound:
    """The status query definitely did not find the effect: calling again is safe."""

    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Unclear:
    """Nobody can say yet (timeout, connection dropped, 5xx, status endpoint down)."""

    reason: str


CallOutcome = Applied | Refused | Unclear
StatusOutcome = Found | NotFound | Unclear
