"""Consumer settings, the dedup window rule, the command line, and the public surface."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import consumers
import dedup
from consumers import Consumer, ConsumerSettings, DeadLetter, RetryLater, Runner, SkipMessage
from dedup.window import check_window
from outbox.errors import ConfigurationError, OutboxError

ROOT = Path(__file__).resolve().parents[2]
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


class TestCommandLine:
    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_CONSUMER")}
        return subprocess.run(
            [sys.executable, "-m", "consumers", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**environ, **env},
            check=False,
        )

    def test_a_bad_setting_is_one_line_naming_env_and_flag_and_exit_2(self) -> None:
        done = self.run("tests.e2e.consumer_app:app", OUTBOXKIT_CONSUMER_MAX_ATTEMPTS="zero")
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1
        assert "OUTBOXKIT_CONSUMER_MAX_ATTEMPTS" in lines[0]
        assert "--max-attempts" in lines[0]

    def test_a_bad_flag_value_is_one_line_and_exit_2(self) -> None:
        done = self.run("tests.e2e.consumer_app:app", "--mode", "sometimes")
        assert done.returncode == 2
        assert len(done.stderr.strip().splitlines()) == 1
        assert "invalid setting mode" in done.stderr

    def test_an_app_path_that_is_not_a_consumer_is_one_line_and_exit_2(self) -> None:
        done = self.run("os:path", OUTBOXKIT_CONSUMER_DATABASE_URL="postgresql://x@h/d")
        assert done.returncode == 2
        assert done.stderr.strip().splitlines() == [
            "python -m consumers: 'os:path' is not a consumers.Consumer (got module)"
        ]

    def test_outbox_consume_is_registered_as_a_command(self) -> None:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "outbox.cli",
                "consume",
                "tests.e2e.consumer_app:app",
                "--max-attempts",
                "-1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "invalid setting max_attempts" in done.stderr


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
            "FailedMessage",
            "Mark",
            "check_window",
            "get_failure",
            "is_marked",
            "list_failures",
            "mark_many",
            "purge_marks",
        } <= set(dedup.__all__)

    def test_handler_control_flow_is_outside_the_error_tree(self) -> None:
        for control in (RetryLater, DeadLetter, SkipMessage):
            assert not issubclass(control, OutboxError)
