"""One Backoff for every retry: its sequence, its cap, its jitter, and its refusals."""

from __future__ import annotations

import random

import pytest

from outbox.backoff import Backoff
from outbox.errors import ConfigurationError


class TestSequence:
    def test_delays_grow_by_the_factor_from_the_base(self) -> None:
        backoff = Backoff(base=0.5, factor=3.0, cap=100.0)
        assert [backoff.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 4.5, 13.5]

    def test_delays_stop_at_the_cap(self) -> None:
        backoff = Backoff(base=1.0, factor=2.0, cap=5.0)
        assert [backoff.delay(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]

    def test_a_daemon_failing_for_days_still_waits_the_cap(self) -> None:
        # base * 2**2000 overflows a float: the cap is the answer, not an OverflowError.
        assert Backoff(base=0.2, cap=30.0).delay(2000) == 30.0
        assert Backoff(base=0.2, factor=2, cap=30.0).delay(5000) == 30.0

    def test_a_factor_of_one_is_a_constant_delay(self) -> None:
        assert {Backoff(base=3.0, factor=1.0, cap=3.0).delay(n) for n in range(1, 50)} == {3.0}

    def test_attempts_are_counted_from_one(self) -> None:
        with pytest.raises(ValueError, match="counted from 1, got 0"):
            Backoff(base=1.0, cap=2.0).delay(0)


class TestJitter:
    def test_jitter_only_shortens_within_its_fraction(self) -> None:
        backoff = Backoff(base=8.0, factor=1.0, cap=8.0, jitter=0.5)
        rng = random.Random(3)
        delays = [backoff.delay(1, rng) for _ in range(1000)]
        assert all(4.0 <= d <= 8.0 for d in delays)
        # It spreads over the whole range.
        assert min(delays) < 4.5
        assert max(delays) > 7.5

    def test_jitter_applies_after_the_cap(self) -> None:
        backoff = Backoff(base=1.0, cap=5.0, jitter=0.1)
        rng = random.Random(1)
        assert all(4.5 <= backoff.delay(10, rng) <= 5.0 for _ in range(200))

    def test_no_jitter_is_exact(self) -> None:
        assert Backoff(base=1.0, cap=5.0).delay(2, random.Random(0)) == 2.0


class TestRefusals:
    @pytest.mark.parametrize(("kwargs", "words"), [
        ({"base": -1.0, "cap": 1.0}, r"base must be >= 0 seconds, got -1"),
        ({"base": 0.0, "cap": -1.0}, r"cap must be >= 0 seconds, got -1"),
        ({"base": 1.0, "cap": 2.0, "factor": 0.5}, r"factor must be >= 1, got 0.5"),
        ({"base": 1.0, "cap": 2.0, "jitter": 1.5}, r"jitter is a fraction in \[0, 1\], got 1.5"),
        ({"base": 1.0, "cap": 2.0, "jitter": -0.1}, r"jitter is a fraction"),
        ({"base": 30.0, "cap": 5.0}, r"base \(30 s\) is over cap \(5 s\).*raise cap or lower base"),
    ])
    def test_bad_numbers_are_a_configuration_error_naming_the_field(
        self, kwargs: dict[str, float], words: str
    ) -> None:
        with pytest.raises(ConfigurationError, match=words):
            Backoff(**kwargs)
