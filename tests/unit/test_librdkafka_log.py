"""librdkafka's log bridge: a repeated line once per window, the rest counted."""

from __future__ import annotations

import logging

import pytest

from outbox.kafka.confluent.logbridge import RepeatsSkipped

FMT = "%s [%s] %s"
REFUSED = ("FAIL", "rdkafka#consumer-1", "[thrd:127.0.0.1:9092/bootstrap]: Connect to "
           "ipv4#127.0.0.1:9092 failed: Connection refused (after {ms}ms in state CONNECT)")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused(bridge: RepeatsSkipped, ms: int = 0, name: str = REFUSED[1]) -> None:
    bridge.log(logging.ERROR, FMT, REFUSED[0], name, REFUSED[2].format(ms=ms))


@pytest.fixture
def bridge(caplog: pytest.LogCaptureFixture) -> tuple[RepeatsSkipped, Clock]:
    caplog.set_level(logging.DEBUG, logger="test.librdkafka")
    clock = Clock()
    return RepeatsSkipped(logging.getLogger("test.librdkafka"), 10.0, clock), clock


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.librdkafka"]


def test_a_line_repeated_within_the_window_is_logged_once_then_counted(
    bridge: tuple[RepeatsSkipped, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    log, clock = bridge
    for n in range(200):  # 20 a second for 10 s, elapsed times differing
        refused(log, ms=n % 3)
        clock.now += 0.05
    assert len(lines(caplog)) == 1
    assert lines(caplog)[0].startswith("FAIL [rdkafka#consumer-1] [thrd:127.0.0.1:9092/")
    assert caplog.records[0].levelno == logging.ERROR
    clock.now = 110.0
    refused(log)  # 10 s after the first: logged, with the count of those left out
    assert len(lines(caplog)) == 2
    assert lines(caplog)[1].endswith("(199 more like it in the last 10 s)")
    refused(log)
    assert len(lines(caplog)) == 2


def test_different_lines_levels_and_clients_are_not_merged(
    bridge: tuple[RepeatsSkipped, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    log, _ = bridge
    refused(log)
    refused(log, name="rdkafka#producer-2")
    log.log(logging.WARNING, FMT, *REFUSED[:2], REFUSED[2].format(ms=0))
    log.log(logging.ERROR, FMT, "FAIL", REFUSED[1], "[thrd:GroupCoordinator]: Disconnected")
    log.log(logging.ERROR, "no arguments")
    assert len(lines(caplog)) == 5
    assert lines(caplog)[-1] == "no arguments"


def test_a_level_the_logger_drops_is_not_formatted_nor_remembered(
    bridge: tuple[RepeatsSkipped, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    log, _ = bridge
    caplog.set_level(logging.WARNING, logger="test.librdkafka")
    log.log(logging.DEBUG, "%s", object())
    assert lines(caplog) == []
    assert log._last == {}


def test_old_lines_are_forgotten_when_there_are_too_many(
    bridge: tuple[RepeatsSkipped, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    log, clock = bridge
    for n in range(1000):
        log.log(logging.INFO, "line %d", n)
    clock.now += 11
    log.log(logging.INFO, "one more")
    assert len(log._last) == 1
    assert len(lines(caplog)) == 1001
