"""The real Kafka broker behind the fixtures: what goes in comes back out intact."""

from __future__ import annotations

import uuid

from kafka import KafkaConsumer, KafkaProducer


def test_message_round_trips_with_key_and_headers_intact(
    kafka_bootstrap: str, kafka_topic: object
) -> None:
    topic = kafka_topic(partitions=3)  # type: ignore[operator]
    message_id = str(uuid.uuid4()).encode()
    headers = [("message-id", message_id), ("type", b"order.submit"), ("empty", b"")]
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    try:
        sent = producer.send(topic, key=b"order-42", value=b'{"qty": 3}', headers=headers)
        metadata = sent.get(timeout=30)
    finally:
        producer.close()

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=f"g-{uuid.uuid4().hex}",
        consumer_timeout_ms=20_000,
    )
    try:
        record = next(iter(consumer))
    finally:
        consumer.close()

    assert (record.partition, record.offset) == (metadata.partition, metadata.offset)
    assert record.key == b"order-42"
    assert record.value == b'{"qty": 3}'
    assert list(record.headers) == headers


def test_same_key_lands_on_one_partition_in_send_order(
    kafka_bootstrap: str, kafka_topic: object
) -> None:
    topic = kafka_topic(partitions=4)  # type: ignore[operator]
    producer = KafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True, linger_ms=5
    )
    try:
        futures = [producer.send(topic, key=b"k", value=str(i).encode()) for i in range(50)]
        producer.flush(timeout=30)
        partitions = {f.get(timeout=10).partition for f in futures}
    finally:
        producer.close()
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=f"g-{uuid.uuid4().hex}",
        consumer_timeout_ms=10_000,
    )
    try:
        values = [int(r.value) for r in consumer]
    finally:
        consumer.close()
    assert len(partitions) == 1
    assert values == list(range(50))
