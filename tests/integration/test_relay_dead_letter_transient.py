"""A dead-letter copy Kafka does not acknowledge (a transient failure) leaves its row where it
is, to be sent, refused and copied again: it is not recorded as refused without a copy.

The publisher is the relay's, on the real broker; only the copy's answer is made transient
(a broker that stops answering is what the fault harness plays; here the point is what the
relay makes of the answer)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox.kafka import Delivery, KafkaClientError
from relay.claims import Failed, OutboxRow
from relay.publisher import Publisher
from relay.settings import RelaySettings

pytestmark = pytest.mark.usefixtures("kafka_client")


@pytest.mark.parametrize("permanent", [False, True])
def test_a_dead_letter_copy_not_acknowledged_is_a_transient_failure(
    kafka_bootstrap: str, database_url: str, monkeypatch: pytest.MonkeyPatch, permanent: bool
) -> None:
    topic = f"dl-{uuid.uuid4().hex[:8]}"
    publisher = Publisher(RelaySettings(database_url=database_url,
                                        kafka_bootstrap=kafka_bootstrap))
    answer = Delivery(error=KafkaClientError("KafkaTimeoutError: no answer"),
                      permanent=permanent)

    def send(records: list[Any], **_: Any) -> list[Delivery]:
        return [answer for _ in records]

    row = OutboxRow(7, uuid.uuid4(), topic, b"k", "t", b"{}", {}, datetime.now(UTC), 0)
    try:
        publisher.missing_topics([topic + ".dlq"])  # created on the real broker, as the relay does
        monkeypatch.setattr(publisher.producer, "send", send)
        outcome = publisher.dead_letter(Failed(row, "InvalidTopicError: refused", True))
    finally:
        publisher.close(timeout_s=5)
    assert outcome.offset is None
    if permanent:  # the copy was refused for good: the row stays refused, without a copy
        assert outcome.permanent
        assert outcome.error == "InvalidTopicError: refused"
    else:  # read and sent again, not left refused without a copy
        assert not outcome.permanent
        assert "dead-letter copy" in outcome.error
