"""Durations in the dedup window's messages read as people write them; a stated topic
retention shorter than the broker's is refused naming both figures."""

from __future__ import annotations

import pytest

from consumers.window import refuse_understatement
from dedup.window import check_window, human_duration
from outbox.errors import ConfigurationError

DAY = 86_400.0


class TestHumanDuration:
    @pytest.mark.parametrize(
        ("seconds", "text"),
        [
            (0, "0 s"),
            (0.5, "0.5 s"),
            (45, "45 s"),
            (60, "1 min"),
            (61, "1 min 1 s"),
            (3600, "1 h"),
            (7500, "2 h 5 min"),
            (7530, "2 h 5 min"),  # two units at most
            (DAY, "1 day"),
            (DAY + 3600, "1 day 1 h"),
            (2_678_400, "31 days"),
            (8 * DAY + 5 * 3600, "8 days 5 h"),
        ],
    )
    def test_a_duration_reads_in_its_largest_unit_and_the_next(
        self, seconds: float, text: str
    ) -> None:
        assert human_duration(seconds) == text


class TestWindowMessages:
    def test_a_short_window_names_every_figure_for_people_and_the_seconds_to_set(self) -> None:
        with pytest.raises(ConfigurationError) as caught:
            check_window(7 * DAY, {"orders": 31 * DAY}, DAY)
        message = str(caught.value)
        assert "dedup retention of 7 days" in message
        assert "retention (31 days)" in message
        assert "max consumer lag (1 day)" in message
        assert "at least 2764800 s (32 days)" in message
        assert "e+" not in message

    def test_a_window_on_a_topic_kept_forever_reads_for_people(self) -> None:
        with pytest.raises(ConfigurationError, match=r"dedup retention of 365 days is unsafe"):
            check_window(365 * DAY, {"ledger": None}, 0)


class TestUnderstatedRetention:
    def test_a_stated_retention_shorter_than_the_brokers_is_refused_naming_both(self) -> None:
        with pytest.raises(ConfigurationError) as caught:
            refuse_understatement(3600, {"orders": 30 * DAY})
        message = str(caught.value)
        assert "keep messages 1 h" in message
        assert "topic 'orders' keeps messages 30 days (retention.ms=2592000000)" in message
        assert "at least 2592000 s" in message
        assert "OUTBOXKIT_CONSUMER_TOPIC_RETENTION_SECONDS" in message

    def test_a_finite_stated_retention_on_a_topic_kept_forever_is_refused(self) -> None:
        with pytest.raises(ConfigurationError, match=r"'ledger' keeps messages forever"):
            refuse_understatement(30 * DAY, {"orders": DAY, "ledger": None})

    def test_a_stated_retention_at_or_above_the_brokers_is_accepted(self) -> None:
        refuse_understatement(30 * DAY, {"orders": 30 * DAY, "other": DAY})
