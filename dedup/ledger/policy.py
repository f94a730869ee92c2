"""How hard the ledger tries to establish an unknown outcome before a human takes over,
and how much of what it saw a human then gets to read."""

from __future__ import annotations

import random
from dataclasses import dataclass

from dedup.ledger.outcomes import DEFAULT_MAX_VALUE_BYTES, MIN_MAX_VALUE_BYTES
from outbox.backoff import POLICY_NAMES, Backoff
from outbox.backoff import check as check_backoff
from outbox.errors import ConfigurationError


@dataclass(frozen=True, kw_only=True)
class ReconcilePolicy:
    """Bounds for reconciling an operation whose outcome we did not see.

    Nothing loops: status queries are bounded by ``max_checks`` and ``max_age_seconds``,
    calls (all with the same idempotency key) by ``max_calls``; past either the operation
    goes to ``needs-human`` with the checks' results as evidence — bounded too, by
    ``evidence_last_events`` and ``evidence_max_value_bytes``.
    """

    max_checks: int = 8
    """Status queries that may answer unclear before a human is asked."""
    max_age_seconds: float | None = 24 * 3600.0
    """An operation still unknown this long after its intent goes to a human."""
    max_calls: int = 3
    """Calls with the same key (the first included) that a not-found answer may trigger."""
    initial_backoff: float = 5.0
    multiplier: float = 2.0
    max_backoff: float = 600.0
    jitter: float = 0.1
    """Fraction (0..1) taken off each delay at random, so many checks spread out."""
    in_flight_grace: float = 60.0
    """Seconds after sending during which a ``pending`` operation may still be in flight in a
    live process; longer than the call's own timeout. After it, pending means unknown."""
    claim_seconds: float = 60.0
    """How long a checker holds an operation it claimed (longer than a status query takes)."""
    evidence_last_events: int = 20
    """At escalation, the last events copied in full into the evidence (with the intent and
    the first call); the ones between are summarised as a count, their kinds and a digest.
    20 shows the latest answers and the retries around them while keeping the evidence of
    an operation checked hundreds of times small enough to read."""
    evidence_max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    """Any single value in that evidence (a response body, an error text) longer than this
    is cut to its head plus its full size and sha256; also the limit for each status
    query's answer as recorded in ``operation_events`` and ``last_error``. 4 KiB keeps the
    start of an error page — usually what tells a human what went wrong."""

    def __post_init__(self) -> None:
        if self.max_checks < 1 or self.max_calls < 1:
            raise ConfigurationError("max_checks and max_calls must be >= 1")
        if self.max_age_seconds is not None and self.max_age_seconds <= 0:
            raise ConfigurationError("max_age_seconds must be > 0 (or None for no age limit)")
        check_backoff(self.initial_backoff, self.multiplier, self.max_backoff, self.jitter,
                      POLICY_NAMES)
        if self.in_flight_grace < 0 or self.claim_seconds <= 0:
            raise ConfigurationError("in_flight_grace must be >= 0 and claim_seconds > 0")
        if self.evidence_last_events < 1:
            raise ConfigurationError(
                f"evidence_last_events must be >= 1 (the answer that led to the escalation "
                f"must be in the evidence), got {self.evidence_last_events}")
        if self.evidence_max_value_bytes < MIN_MAX_VALUE_BYTES:
            raise ConfigurationError(
                f"evidence_max_value_bytes must be >= {MIN_MAX_VALUE_BYTES} (room for the "
                f"truncation note), got {self.evidence_max_value_bytes}")

    def backoff(self, checks: int, rng: random.Random | None = None) -> float:
        """Seconds until the next status query after *checks* unclear ones (0 → first)."""
        return self.schedule.delay(max(1, checks), rng)

    @property
    def schedule(self) -> Backoff:
        """The delays between status queries as a :class:`Backoff`."""
        return Backoff(base=self.initial_backoff, factor=self.multiplier, cap=self.max_backoff,
                       jitter=self.jitter)
