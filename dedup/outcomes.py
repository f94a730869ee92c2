"""What an outside system told us, as small typed values.

A call answers :class:`Applied` (the system took it), :class:`Refused` (a definite no) or
:class:`Unclear` (timeout, dropped connection, 5xx: it may or may not have been applied).
A status query answers :class:`Found`, :class:`NotFound` (definitely not there: safe to call
again with the same key) or :class:`Unclear` (the status endpoint could not say). Only
``Applied``/``Refused``/``Found`` carry :class:`Evidence`; the ledger never invents it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import ConfigurationError


def canonical_digest(value: Any) -> str:
    """``sha256:<hex>`` of *value* as canonical JSON (sorted keys, no spaces, UTF-8).

    Two requests that are equal as JSON have the same digest whatever their key order.
    """
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"the request/response must be JSON (dicts, lists, str, numbers, bool, None): {exc}"
        ) from exc
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


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
        cls, response: Any, *, reference: str | None = None, **detail: Any
    ) -> Evidence:
        """Evidence from a JSON *response*: its digest is kept, not the response itself."""
        return cls(reference=reference, response_digest=canonical_digest(response), detail=detail)

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
