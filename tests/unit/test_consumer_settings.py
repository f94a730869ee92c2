"""Consumer settings, the dedup window rule and the public surface (the command line:
test_consumer_cli.py)."""

from __future__ import annotations

import pytest

import consumers
import dedup
from consumers import (
    Consumer,
    ConsumerSettings,
    DeadLetter,
    RetryLater,
    Runner,
    SkipMessage,
    failures,
)
from dedup.window import check_window
from outbox.errors import ConfigurationError, OutboxError

DAY = 86_400.0


class TestDedupWindow:
    def test_a_window_covering_retention_plus_lag_is_accepted(self) -> None:
        check_window(8 * DAY, {"orders": 7 * DAY}, DAY)

    def test_a_window_shorter_than_retention_plus_lag_is_refused_naming_the_minimum(
        self,
    ) -> None:
        with pytest.raises(ConfigurationError, match=r"'orders'.*at least 691200 s"):
            check_window(7 * DAY, {"orders": 7 * DAY, "other": 60.0}, DAY)

    def test_a_topic_that_keeps_messages_forever_needs_marks_kept_forever(self) -> None:
        with pytest.raises(ConfigurationError, match="forever"):
            check_window(365 * DAY, {"ledger": None}, 0)
        check_window(0, {"ledger": None}, DAY)  # 0 keeps marks forever: safe

    def test_a_configured_topic_retention_is_checked_before_anything_starts(self) -> None:
        settings = ConsumerSettings(
            database_url="postgresql://x@127.0.0.1:1/db",  # type: ignore[arg-type]
            kafka_bootstrap="127.0.0.1:1",
            dedup_retention_seconds=3600,
            topic_retention_seconds=DAY,
        )
        app = Consumer("g", settings=settings)
        app.register("orders", lambda ctx, m: None)
        with pytest.raises(ConfigurationError, match="shorter than topic 'orders'"):
            Runner(app).run()


class TestSettings:
    def test_retries_are_not_bound_by_the_poll_interval(self) -> None:
        # A retry parks its partition and the loop keeps polling: a long budget is fine.
        s = ConsumerSettings(max_attempts=50, backoff_max_seconds=30, max_poll_interval_ms=10_000)
        assert sum(s.backoff(n) for n in range(1, s.max_attempts)) > 10

    def test_backoff_doubles_up_to_its_maximum(self) -> None:
        s = ConsumerSettings(backoff_initial_seconds=0.5, backoff_max_seconds=3)
        assert [s.backoff(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]


class TestPublicSurface:
    def test_consumers_exports_its_api_sorted(self) -> None:
        assert consumers.__all__ == sorted(consumers.__all__)
        assert set(consumers.__all__) == {
            "Consumer",
            "ConsumerError",
            "ConsumerSettings",
            "DeadLetter",
            "FailureNotFound",
            "HandlerContext",
            "HandlerControl",
            "MalformedMessage",
            "Registration",
            "RetryLater",
            "Runner",
            "SkipMessage",
            "rehandle",
            "republish",
        }

    def test_dedup_exports_the_inbox_names(self) -> None:
        assert {
            "Mark",
            "check_window",
            "is_marked",
            "mark_many",
            "purge_marks",
        } <= set(dedup.__all__)
        # The failures table is the consumers' own (consumers.failures).
        assert all(hasattr(failures, name)
                   for name in ("FailedMessage", "get_failure", "list_failures"))

    def test_handler_control_flow_is_outside_the_error_tree(self) -> None:
        for control in (RetryLater, DeadLetter, SkipMessage):
            assert not issubclass(control, OutboxError)
