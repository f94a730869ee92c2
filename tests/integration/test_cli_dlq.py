"""`outbox dlq list` / `replay`: dead-lettered messages, replayed to Kafka or re-handled."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from kafka import KafkaConsumer
from sqlalchemy import Connection, Engine, text

from consumers.failures import mark_dead_lettered, record_attempt
from tests.integration.cli_support import one_line, outbox

APP = "tests.integration.cli_dlq_app:app"


def dead_letter(conn: Connection, topic: str, offset: int, item: str) -> tuple[int, str]:
    """A message the `orders` group gave up on; returns (failure id, message id)."""
    message_id = str(uuid.uuid4())
    record_attempt(conn, group="orders", topic=topic, partition=0, offset=offset,
                   message_id=message_id, key=b"acme",
                   payload=json.dumps({"item": item}).encode(),
                   headers={"message-id": message_id}, error="supplier API down")
    mark_dead_lettered(conn, group="orders", topic=topic, partition=0, offset=offset,
                       dlq_topic=f"{topic}.dlq", dlq_partition=0, dlq_offset=offset)
    failure_id = conn.execute(text("SELECT id FROM outboxkit.consumer_failures "
                                   "WHERE kafka_offset = :o AND topic = :t"),
                              {"o": offset, "t": topic}).scalar_one()
    return int(failure_id), message_id


def test_list_shows_dead_lettered_messages_of_a_group(engine: Engine, database_url: str) -> None:
    with engine.begin() as conn:
        failure_id, message_id = dead_letter(conn, "order.submit", 7, "widget")
    table = outbox("dlq", "list", "--group", "orders", "--database-url", database_url)
    assert table.returncode == 0, table.stderr
    assert message_id in table.stdout
    assert "supplier API down" in table.stdout
    as_json = outbox("dlq", "list", "--json", OUTBOXKIT_DATABASE_URL=database_url)
    [row] = json.loads(as_json.stdout)
    assert (row["id"], row["status"], row["payload"]) == (
        failure_id, "dead-lettered", '{"item": "widget"}')
    other = outbox("dlq", "list", "--group", "billing", "--json", "--database-url", database_url)
    assert json.loads(other.stdout) == []


def test_replay_republishes_the_exact_bytes_to_the_original_topic(
    engine: Engine, database_url: str, kafka_bootstrap: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic()
    with engine.begin() as conn:
        failure_id, message_id = dead_letter(conn, topic, 3, "widget")
    result = outbox("dlq", "replay", str(failure_id), "--database-url", database_url,
                    "--kafka-bootstrap", kafka_bootstrap)
    assert result.returncode == 0, result.stderr
    assert f"republished to {topic}[0]@0" in result.stdout
    consumer = KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap,
                             auto_offset_reset="earliest", consumer_timeout_ms=10_000)
    try:
        record = next(iter(consumer))
    finally:
        consumer.close()
    assert record.value == b'{"item": "widget"}'
    assert dict(record.headers)["message-id"] == message_id.encode()
    with engine.connect() as conn:
        status = conn.execute(text("SELECT status FROM outboxkit.consumer_failures WHERE id = :i"),
                              {"i": failure_id}).scalar_one()
    assert status == "replayed"
    again = outbox("dlq", "replay", str(failure_id), "--database-url", database_url,
                   "--kafka-bootstrap", kafka_bootstrap)
    assert again.returncode == 1
    assert "was replayed already" in one_line(again)
    # A replay killed before its send left it 'replayed': --again sends it once more.
    forced = outbox("dlq", "replay", str(failure_id), "--again", "--actor", "ann",
                    "--database-url", database_url, "--kafka-bootstrap", kafka_bootstrap)
    assert forced.returncode == 0, forced.stderr
    assert f"republished to {topic}[0]@1" in forced.stdout
    with engine.connect() as conn:
        who = conn.execute(text("SELECT replayed_by FROM outboxkit.consumer_failures "
                                "WHERE id = :i"), {"i": failure_id}).scalar_one()
    assert who == "ann"


def test_rehandle_runs_the_apps_handler_once_in_its_transaction(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.cli_orders (message_id text PRIMARY KEY, "
                          "item text)"))
        good, message_id = dead_letter(conn, "order.submit", 1, "widget")
        poison, _ = dead_letter(conn, "order.submit", 2, "poison")
    result = outbox("dlq", "replay", str(good), "--rehandle", APP,
                    "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    assert f"failure {good}: handled again by orders" in result.stdout
    failed = outbox("dlq", "replay", str(poison), "--rehandle", APP,
                    "--database-url", database_url)
    assert failed.returncode == 1
    assert "still cannot handle poison" in one_line(failed)
    with engine.connect() as conn:
        orders = conn.execute(text("SELECT message_id, item FROM public.cli_orders")).all()
        statuses = dict(conn.execute(text(
            "SELECT id, status FROM outboxkit.consumer_failures")).all())
    assert [tuple(o) for o in orders] == [(message_id, "widget")]
    assert statuses == {good: "replayed", poison: "dead-lettered"}


def test_replay_of_an_unknown_failure_is_one_line_and_exit_1(database_url: str) -> None:
    result = outbox("dlq", "replay", "424242", "--database-url", database_url,
                    "--kafka-bootstrap", "127.0.0.1:9")
    assert result.returncode == 1
    assert "no consumer failure with id 424242" in one_line(result)


def test_discard_keeps_the_dead_letter_with_who_and_why_and_only_once(
    engine: Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        first, _ = dead_letter(conn, "order.submit", 11, "widget")
        second, _ = dead_letter(conn, "order.submit", 12, "widget")
    done = outbox("dlq", "discard", str(first), "--reason", "customer cancelled",
                  "--actor", "ann", "--database-url", database_url)
    assert done.returncode == 0, done.stderr
    assert f"failure {first}: discarded by ann" in done.stdout
    listed = json.loads(outbox("dlq", "list", "--status", "discarded", "--json",
                               "--database-url", database_url).stdout)
    assert [(r["id"], r["discarded_by"], r["discard_reason"]) for r in listed] == [
        (first, "ann", "customer cancelled")]
    # All or none: the second is dead-lettered, the first no longer is.
    again = outbox("dlq", "discard", str(second), str(first), "--reason", "x", "--actor", "bob",
                   "--database-url", database_url)
    assert again.returncode == 1
    assert f"failure {first} is 'discarded', not dead-lettered" in one_line(again)
    still = json.loads(outbox("dlq", "list", "--json", "--database-url", database_url).stdout)
    assert [r["id"] for r in still] == [second]
