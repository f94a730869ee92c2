"""kafka-python's poll during a broker outage: a lost broker is waited out, not the end.

kafka-python 3.0 raises ``KafkaConnectionError`` out of ``KafkaConsumer.poll`` when it cannot
reach the group coordinator (seen in tests/e2e/test_relay_failures.py's outage: the consumer
process exited). The backend's poll must hand over nothing and let the runner poll again,
as librdkafka does; a refusal that trying again cannot change still raises.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kafka import errors as kafka_errors

from outbox.kafka.kafka_python import KafkaPythonConsumer


class _Raising:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def poll(self, **_: Any) -> dict[Any, Any]:
        self.calls += 1
        raise self.error


def _consumer(inner: _Raising) -> KafkaPythonConsumer:
    consumer = object.__new__(KafkaPythonConsumer)  # only poll's error handling is exercised
    consumer._consumer = inner
    return consumer


def test_a_lost_broker_gives_an_empty_poll_after_the_wait() -> None:
    inner = _Raising(kafka_errors.KafkaConnectionError("111 ECONNREFUSED"))
    started = time.monotonic()
    assert _consumer(inner).poll(timeout_ms=200, max_records=10) == []
    assert time.monotonic() - started >= 0.19  # no busy loop of reconnects
    assert inner.calls == 1


def test_a_refusal_that_will_not_change_still_raises() -> None:
    inner = _Raising(kafka_errors.TopicAuthorizationFailedError("not allowed"))
    with pytest.raises(kafka_errors.TopicAuthorizationFailedError):
        _consumer(inner).poll(timeout_ms=10, max_records=10)
