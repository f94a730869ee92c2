"""One way to compute a retry delay: exponential growth up to a cap, shortened at random.

Every retry in outboxkit waits by a :class:`Backoff`: a run's requeue (``RetryPolicy``), the
ledger's status checks (``ReconcilePolicy``), a consumer's failed message
(``ConsumerSettings``) and the daemons' reconnects and re-records (``outbox.runtime``). Only
their numbers differ.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from outbox.errors import ConfigurationError

# What the four numbers are called where a caller exposes them under other names (a policy's
# ``initial_backoff``...): errors then name the caller's fields, not ours.
FIELD_NAMES = ("base", "factor", "cap", "jitter")
POLICY_NAMES = ("initial_backoff", "multiplier", "max_backoff", "jitter")


def check(
    base: float, factor: float, cap: float, jitter: float,
    names: tuple[str, str, str, str] = FIELD_NAMES,
) -> None:
    """Raise :class:`ConfigurationError` naming the first of the four numbers that is wrong."""
    base_name, factor_name, cap_name, jitter_name = names
    if base < 0:
        raise ConfigurationError(f"{base_name} must be >= 0 seconds, got {base:g}")
    if cap < 0:
        raise ConfigurationError(f"{cap_name} must be >= 0 seconds, got {cap:g}")
    if factor < 1:
        # Below 1 each retry would come sooner than the last: a tight loop against whatever
        # is failing.
        raise ConfigurationError(f"{factor_name} must be >= 1, got {factor:g}")
    if base > cap:
        # Capped silently, the first retry would come sooner than asked: one of the two values
        # is a mistake, and only the caller knows which.
        raise ConfigurationError(
            f"{base_name} ({base:g} s) is over {cap_name} ({cap:g} s): the first delay cannot "
            f"exceed the largest; raise {cap_name} or lower {base_name}"
        )
    if not 0 <= jitter <= 1:
        raise ConfigurationError(f"{jitter_name} is a fraction in [0, 1], got {jitter:g}")


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """Delays of ``base * factor**(attempt - 1)`` seconds, at most *cap*, each shortened by a
    random fraction of at most *jitter* (so that many retries spread out instead of arriving
    together). Jitter only ever shortens: no delay exceeds its un-jittered value."""

    base: float
    factor: float = 2.0
    cap: float
    jitter: float = 0.0

    def __post_init__(self) -> None:
        check(self.base, self.factor, self.cap, self.jitter)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number *attempt* (1-based)."""
        if attempt < 1:
            raise ValueError(f"attempts are counted from 1, got {attempt}")
        try:
            grown = self.base * self.factor ** (attempt - 1)
        except OverflowError:  # a daemon failing for hours: far past the cap anyway
            grown = self.cap
        full = float(min(self.cap, grown))
        if not self.jitter:
            return full
        return full * (1 - self.jitter * (rng or random).random())  # spread, not crypto
