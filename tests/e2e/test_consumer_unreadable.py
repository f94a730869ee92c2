"""A record the Kafka client itself cannot parse does not stop its partition: it is
recorded in the failures table by position, skipped, and the records behind it flow."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
from kafka import KafkaProducer
from sqlalchemy import Engine

from consumers.failures import list_failures
from tests.e2e.conftest import wait_until
from tests.e2e.consumer_support import InProcess, create_effects, effects
from tests.e2e.test_consumer_idempotence import make_app

pytestmark = pytest.mark.timeout(180)


class NotUtf8(str):
    """A header name that kafka-python writes as bytes that are not UTF-8 (its reader then
    fails on the record, as it would on one written by a buggy client in another language)."""

    __slots__ = ()

    def encode(self, *args: object, **kwargs: object) -> bytes:
        return b"\xff\xfe"


def test_an_unparseable_record_is_recorded_and_skipped(
    engine: Engine, database_url: str, kafka_bootstrap: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(partitions=2)
    create_effects(engine)
    ids = [str(uuid.uuid4()) for _ in range(4)]
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        for n, message_id in enumerate(ids):
            headers = [("message-id", message_id.encode())]
            if n == 1:
                headers.append((NotUtf8("x"), b"v"))
            producer.send(topic, value=json.dumps({"n": n}).encode(), partition=0,
                          headers=headers)
            # One record batch each: kafka-python cannot read past a bad record inside a batch
            # (those records would be recorded and skipped one by one, see consumers.unreadable).
            producer.flush(timeout=30)
    finally:
        producer.close()
    good = [ids[0], ids[2], ids[3]]
    app = make_app(database_url, kafka_bootstrap, topic)
    with InProcess(app):
        wait_until(lambda: set(effects(engine)) == set(good), 60, "the readable records")
    assert effects(engine) == dict.fromkeys(good, 1)
    with engine.connect() as conn:
        failed = list_failures(conn, group=app.group_id)
    assert [(f.topic, f.partition, f.offset, f.status) for f in failed] == [
        (topic, 0, 1, "dead-lettered")
    ]
    assert "CorruptRecordError" in (failed[0].last_error or "")
