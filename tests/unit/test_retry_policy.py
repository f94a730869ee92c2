"""Retry policy arithmetic and classification, decided outside the model."""

from __future__ import annotations

import random

import pytest

from outbox.errors import CheckpointTooLarge, ConfigurationError
from outbox.runs.retry import RetryPolicy
from outbox.runs.states import RunState


class Flaky(Exception):
    pass


class Fatal(Flaky):
    pass


def test_backoff_grows_exponentially_up_to_the_cap_without_jitter() -> None:
    policy = RetryPolicy(initial_backoff=1.0, multiplier=2.0, max_backoff=5.0, jitter=0.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_jitter_only_shortens_the_delay_within_its_fraction() -> None:
    policy = RetryPolicy(initial_backoff=10.0, multiplier=1.0, jitter=0.25)
    rng = random.Random(7)
    delays = [policy.backoff(1, rng) for _ in range(500)]
    assert all(7.5 <= d <= 10.0 for d in delays)
    assert max(delays) - min(delays) > 1.0  # it does spread


def test_final_types_win_over_retryable_ones() -> None:
    policy = RetryPolicy(retryable=(Flaky,), final=(Fatal,))
    assert policy.is_retryable(Flaky("x"))
    assert not policy.is_retryable(Fatal("x"))


def test_unlisted_errors_and_outboxkit_run_errors_are_final() -> None:
    policy = RetryPolicy(retryable=(Flaky,))
    assert not policy.is_retryable(KeyError("x"))
    assert not RetryPolicy().is_retryable(CheckpointTooLarge(10, 5))


@pytest.mark.parametrize("kwargs", [
    {"max_attempts": 0}, {"jitter": 1.5}, {"multiplier": 0.5}, {"initial_backoff": -1},
    {"give_up_state": RunState.DONE},
])
def test_invalid_policies_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_an_initial_backoff_over_the_max_is_refused_naming_both() -> None:
    # It used to be capped silently at max_backoff.
    with pytest.raises(ConfigurationError, match=r"initial_backoff \(30 s\).*max_backoff \(5 s\)"):
        RetryPolicy(initial_backoff=30, max_backoff=5)
