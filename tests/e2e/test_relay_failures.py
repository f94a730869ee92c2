"""Kafka outages and messages Kafka refuses: nothing lost, the rest keeps flowing."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from sqlalchemy import Engine, text

from outbox.messages.backlog import retry_messages
from outbox.messages.envelope import Envelope
from outbox.testing.services import LocalServices
from tests.e2e.conftest import (
    TOO_LARGE,
    RelayProcesses,
    count_status,
    emit_batch,
    read_topic,
    wait_until,
)
from tests.e2e.consumer_support import ConsumerProcesses, create_effects, effects
from tests.e2e.test_relay_publishes import _free_port, _get

REFUSED = "Connection refused"  # librdkafka's line per refused connection attempt


def make_topic(bootstrap: str, name: str, **config: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, 1, 1, topic_configs=config)])
    finally:
        admin.close()


def big_payload(size: int) -> dict[str, str]:
    return {"blob": os.urandom(size // 2).hex()}  # random: compression cannot shrink it


# The only broker outage of `make test` (the fault harness plays it in `make faults`): the relay
# and a consumer live through it with either Kafka client, the relay says it is not ready,
# and afterwards every committed message is in Kafka and has had its effect exactly once.
@pytest.mark.timeout(300)
def test_broker_stopped_for_20s_under_load_then_everything_arrives(
    engine: Engine, relays: RelayProcesses, tmp_path: Path, database_url: str, kafka_client: str
) -> None:
    # A broker of its own: stopping the session's broker would disturb other tests.
    services = LocalServices(tmp_path / "outage")
    broker = services.start_kafka()
    relays.kafka_bootstrap = broker.bootstrap
    topic = f"outage-{uuid.uuid4().hex[:8]}"
    make_topic(broker.bootstrap, topic)
    create_effects(engine)
    (tmp_path / "consumer").mkdir()
    consumers = ConsumerProcesses(database_url, broker.bootstrap, topic, tmp_path / "consumer")
    consumer = consumers.start()
    port = _free_port()
    proc = relays.start("outage", http_port=port, delivery_timeout_ms=300_000)
    readiness: list[int] = []
    stop, stop_probe = threading.Event(), threading.Event()

    def probe() -> None:
        while not stop_probe.is_set():
            readiness.append(_get(port, "/readyz")[0])
            time.sleep(0.25)

    def load() -> None:
        i = 0
        while not stop.is_set():
            emit_batch(
                engine,
                [
                    Envelope(topic=topic, type="t", key=f"k{(i + j) % 20}", payload={"n": i + j})
                    for j in range(20)
                ],
            )
            i += 20
            time.sleep(0.05)

    prober, writer = threading.Thread(target=probe), threading.Thread(target=load)
    try:
        prober.start()
        writer.start()
        # The consumer must be reading before the outage: one that cannot reach the broker at
        # start-up gives up (a failed start, not what this test is about).
        wait_until(lambda: count_status(engine, "published") > 100 and len(effects(engine)) > 0,
                   60, "publishing and consuming under load")
        services.stop_kafka()
        outage_started = len(readiness)
        time.sleep(20)
        assert proc.poll() is None, "the relay crashed while the broker was down"
        assert consumer.poll() is None, "the consumer crashed while the broker was down"
        went_unready = 503 in readiness[outage_started:]
        services.start_kafka()
        time.sleep(3)
        stop.set()
        writer.join()
        wait_until(lambda: count_status(engine, "pending") == 0, 120, "the backlog to drain")
        wait_until(lambda: readiness[-1] == 200, 30, "readiness to come back")
        in_kafka = {
            dict(r.headers)["message-id"].decode() for r in read_topic(broker.bootstrap, topic)
        }
        try:
            wait_until(lambda: len(effects(engine)) == len(in_kafka), 120,
                       "the consumer to catch up")
        except AssertionError as exc:
            # Rare (once in CI, not in 30 runs here): say which side is short, and what the
            # consumer did, so the next occurrence can be diagnosed.
            raise AssertionError(
                f"{exc}: {len(effects(engine))} effects, {len(in_kafka)} in Kafka, "
                f"{count_status(engine, 'published')} published; consumer exit code "
                f"{consumer.poll()}\n{_without_refusals(consumers.logs())[-20_000:]}"
            ) from None
        assert consumer.poll() is None, consumers.logs()
    finally:
        stop.set()
        stop_probe.set()
        prober.join()
        writer.join()
        consumers.stop_all()
        services.down()
    assert went_unready
    assert proc.poll() is None
    with engine.connect() as conn:
        committed = {
            str(m)
            for (m,) in conn.execute(text("SELECT message_id FROM outboxkit.outbox_messages"))
        }
    assert committed == in_kafka
    assert count_status(engine, "failed") == 0
    assert effects(engine) == dict.fromkeys(committed, 1), consumers.logs()
    if kafka_client == "confluent":
        # A 20 s outage is a few lines per client, not one per reconnect attempt (a librdkafka
        # consumer retries ~20 times a second: 440 ERROR lines before repeats were skipped).
        # kafka-python logs through its own loggers ("kafka.*"), the application's to tune.
        for name, logged in (
            ("consumer", consumers.logs()),
            ("relay", (relays.log_dir / "outage.log").read_text(errors="replace")),
        ):
            refused = logged.count(REFUSED)
            assert refused <= 30, f"the {name} logged {refused} refused connections"


def test_message_the_broker_refuses_goes_to_the_dead_letter_topic_and_the_rest_flows(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    topic = f"poison-{uuid.uuid4().hex[:8]}"
    make_topic(kafka_bootstrap, topic, **{"max.message.bytes": "4000"})
    poison = Envelope(topic=topic, type="t", key="k1", payload=big_payload(20_000))
    emit_batch(
        engine,
        [
            Envelope(topic=topic, type="t", key="k1", payload={"i": 0}),
            poison,
            *[
                Envelope(topic=topic, type="t", key=f"k{i % 3}", payload={"i": i})
                for i in range(1, 30)
            ],
        ],
    )
    relays.start()
    wait_until(lambda: count_status(engine, "published") == 30, 60, "30 published")
    wait_until(lambda: count_status(engine, "failed") == 1, 30, "the poison marked failed")
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT status, last_error, blocking, dlq_offset FROM outboxkit.message_status "
                "WHERE message_id = :m"
            ),
            {"m": poison.message_id},
        ).one()
    assert TOO_LARGE.search(row.last_error)
    assert row.blocking is False
    assert row.dlq_offset is not None  # where the dead-letter copy landed
    dead = read_topic(kafka_bootstrap, topic + ".dlq")
    assert len(dead) == 1
    headers = dict(dead[0].headers)
    assert headers["message-id"] == str(poison.message_id).encode()
    assert TOO_LARGE.search(headers["x-outboxkit-error"].decode())
    assert headers["x-outboxkit-original-topic"] == topic.encode()


def test_block_mode_holds_back_the_refused_key_until_an_operator_retries(
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses
) -> None:
    topic = f"block-{uuid.uuid4().hex[:8]}"
    make_topic(kafka_bootstrap, topic, **{"max.message.bytes": "4000"})
    emit_batch(engine, [Envelope(topic=topic, type="t", key="stuck", payload=big_payload(20_000))])
    emit_batch(
        engine,
        [Envelope(topic=topic, type="t", key="stuck", payload={"after": i}) for i in range(5)],
    )
    emit_batch(
        engine, [Envelope(topic=topic, type="t", key="free", payload={"i": i}) for i in range(10)]
    )
    relays.start(on_permanent_failure="block")
    wait_until(lambda: count_status(engine, "published") == 10, 60, "the free key published")
    time.sleep(2)  # several more claim rounds: the stuck key must stay held back
    assert count_status(engine, "failed") == 1
    assert count_status(engine, "pending") == 5
    assert (
        read_topic(kafka_bootstrap, topic + ".dlq", timeout_s=5) == []
        if _topic_exists(kafka_bootstrap, topic + ".dlq")
        else True
    )

    # The operator raises the topic's limit, then retries the failed message.
    _raise_limit(kafka_bootstrap, topic)
    with engine.begin() as conn:
        assert retry_messages(conn) == 1
    wait_until(lambda: count_status(engine, "published") == 16, 60, "all 16 published")
    stuck = [r for r in read_topic(kafka_bootstrap, topic) if r.key == b"stuck"]
    assert [len(r.value) > 1000 for r in stuck] == [True, False, False, False, False, False]


def _topic_exists(bootstrap: str, topic: str) -> bool:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        return topic in admin.list_topics()
    finally:
        admin.close()


def _without_refusals(logs: str) -> str:
    """The logs less librdkafka's line per refused connection (hundreds in an outage)."""
    return "\n".join(line for line in logs.splitlines() if REFUSED not in line)


# --- a refused record in the middle of a key's run (issue 32) ----------------------------------
# Key K has 12 records in one claim, the 6th over the topic's max.message.bytes (the producer's
# own limit, 1 MB, is far larger, so the broker is what refuses it), other keys interleaved, one
# partition. With an idempotent producer, a batch refused in the middle of a partition's
# sequence is what lets later records of a key land before earlier ones. What counts is the
# order of each message's first delivery; re-sends are allowed, and reported.
RUN = 12
POISON_AT = 6  # K's 6th record, index 5


@dataclass(frozen=True)
class Layout:
    """How the producer batches the run: the topic's limit, the sizes and the batch size."""

    limit: int  # the topic's max.message.bytes
    poison: int  # the poison's payload bytes: over the limit
    pad: int  # random bytes in every other record
    batch: int  # the producer's batch size


LAYOUTS = {
    # Batches of about 1 KB, a few records each, the poison alone in its own, with batches in
    # flight before and after it.
    "poison-alone": Layout(limit=4000, poison=20_000, pad=0, batch=1024),
    # Batches of 64 KB: the poison's batch also holds the ten records before it (and a few
    # after), the next batch the rest. Good records are refused with the poison while the
    # batch behind them is acknowledged.
    "poison-shares": Layout(limit=30_000, poison=60_000, pad=300, batch=64_000),
}


def _mid_run_batch(
    topic: str, layout: Layout
) -> tuple[list[Envelope], dict[str, tuple[str, int]], Envelope]:
    """K's run with the others interleaved, each message id's (key, n), and the poison."""
    envelopes: list[Envelope] = []
    numbered: dict[str, tuple[str, int]] = {}
    poison: Envelope | None = None
    for n in range(1, RUN + 1):
        pad = big_payload(layout.pad) if layout.pad else {}
        payload: dict[str, object] = {"n": n, **pad}
        if n == POISON_AT:
            payload = {"n": n, **big_payload(layout.poison)}
        k = Envelope(topic=topic, type="t", key="K", payload=payload)
        other_key = f"o{n % 3}"
        other = Envelope(topic=topic, type="t", key=other_key, payload={"n": n, **pad})
        envelopes += [k, other]
        numbered[str(k.message_id)] = ("K", n)
        numbered[str(other.message_id)] = (other_key, n)
        if n == POISON_AT:
            poison = k
    assert poison is not None
    return envelopes, numbered, poison


def _first_deliveries(
    bootstrap: str, topic: str, numbered: dict[str, tuple[str, int]]
) -> tuple[dict[str, list[int]], int]:
    """Each key's numbers in the order of their first delivery, and how many re-sends."""
    order: dict[str, list[int]] = {}
    seen: set[str] = set()
    duplicates = 0
    for record in read_topic(bootstrap, topic):
        message_id = dict(record.headers)["message-id"].decode()
        if message_id in seen:
            duplicates += 1
            continue
        seen.add(message_id)
        key, n = numbered[message_id]
        order.setdefault(key, []).append(n)
    return order, duplicates


def _others(numbered: dict[str, tuple[str, int]]) -> dict[str, list[int]]:
    want: dict[str, list[int]] = {}
    for key, n in numbered.values():
        if key != "K":
            want.setdefault(key, []).append(n)
    return {key: sorted(ns) for key, ns in want.items()}


def _emit_mid_run(
    engine: Engine, bootstrap: str, layout: Layout
) -> tuple[str, dict[str, tuple[str, int]], Envelope]:
    topic = f"midrun-{uuid.uuid4().hex[:8]}"
    make_topic(bootstrap, topic, **{"max.message.bytes": str(layout.limit)})
    envelopes, numbered, poison = _mid_run_batch(topic, layout)
    # A transaction each, so that the ids interleave the keys (emit_many groups its rows by
    # key); all committed before the relay starts, so they are one claim.
    for envelope in envelopes:
        emit_batch(engine, [envelope])
    return topic, numbered, poison


def _relay_settings(layout: Layout) -> dict[str, Any]:
    return {"producer_batch_bytes": layout.batch, "linger_ms": 20}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_block_mode_with_a_refused_record_in_the_middle_of_a_keys_run(  # noqa: PLR0917
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses, kafka_client: str,
    layout: str, record_property: Callable[[str, object], None],
) -> None:
    topic, numbered, poison = _emit_mid_run(engine, kafka_bootstrap, LAYOUTS[layout])
    relays.start(on_permanent_failure="block", **_relay_settings(LAYOUTS[layout]))
    before = POISON_AT - 1
    _wait(
        engine,
        lambda: count_status(engine, "failed") == 1
        and count_status(engine, "published") >= RUN + before,
        60,
        "the poison marked failed, the other keys and K's records before it published",
    )
    time.sleep(2)  # several more claim rounds: the rest of K must stay held back
    order, duplicates = _first_deliveries(kafka_bootstrap, topic, numbered)
    assert order.get("K") == list(range(1, POISON_AT)), order.get("K")
    assert {k: v for k, v in order.items() if k != "K"} == _others(numbered)
    assert count_status(engine, "published") == RUN + before
    assert count_status(engine, "pending") == RUN - POISON_AT

    # The operator raises the topic's limit, then retries the refused message.
    _raise_limit(kafka_bootstrap, topic)
    with engine.begin() as conn:
        assert retry_messages(conn) == 1
    _wait(engine, lambda: count_status(engine, "published") == 2 * RUN, 60, "all published")
    order, duplicates = _first_deliveries(kafka_bootstrap, topic, numbered)
    record_property("duplicates", duplicates)
    print(f"{kafka_client}: {duplicates} re-sent records in {topic}")
    assert order["K"] == list(range(1, RUN + 1)), order["K"]
    assert {k: v for k, v in order.items() if k != "K"} == _others(numbered)
    assert count_status(engine, "failed") == 0
    assert not _topic_exists(kafka_bootstrap, topic + ".dlq")
    assert str(poison.message_id) in {
        dict(r.headers)["message-id"].decode() for r in read_topic(kafka_bootstrap, topic)
    }
    _check_relay_logs(relays, LAYOUTS[layout])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dead_letter_mode_with_a_refused_record_in_the_middle_of_a_keys_run(  # noqa: PLR0917
    engine: Engine, kafka_bootstrap: str, relays: RelayProcesses, kafka_client: str,
    layout: str, record_property: Callable[[str, object], None],
) -> None:
    topic, numbered, poison = _emit_mid_run(engine, kafka_bootstrap, LAYOUTS[layout])
    relays.start(**_relay_settings(LAYOUTS[layout]))
    _wait(engine, lambda: count_status(engine, "published") == 2 * RUN - 1, 60,
          "the rest published")
    _wait(engine, lambda: count_status(engine, "failed") == 1, 30, "the poison dead-lettered")
    order, duplicates = _first_deliveries(kafka_bootstrap, topic, numbered)
    record_property("duplicates", duplicates)
    print(f"{kafka_client}: {duplicates} re-sent records in {topic}")
    assert order["K"] == [n for n in range(1, RUN + 1) if n != POISON_AT], order["K"]
    assert {k: v for k, v in order.items() if k != "K"} == _others(numbered)
    dead = read_topic(kafka_bootstrap, topic + ".dlq")
    assert [dict(r.headers)["message-id"].decode() for r in dead] == [str(poison.message_id)]
    assert TOO_LARGE.search(dict(dead[0].headers)["x-outboxkit-error"].decode())
    _check_relay_logs(relays, LAYOUTS[layout])


def _check_relay_logs(relays: RelayProcesses, layout: Layout) -> None:
    """No key's order broke, and a topic limit below the producer's batch size was warned of."""
    logged = "".join(p.read_text(errors="replace") for p in relays.log_dir.glob("*.log"))
    assert "order is broken" not in logged, logged[-5000:]
    assert ("below the relay's producer batch size" in logged) == (layout.limit < layout.batch)


def _wait(engine: Engine, predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """:func:`wait_until`, saying on a timeout where each row of the topic is."""
    try:
        wait_until(predicate, timeout, what)
    except AssertionError as exc:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, key, status, failure_state, left(last_error, 300) "
                    "FROM outboxkit.message_status ORDER BY id"
                )
            ).all()
        raise AssertionError(f"{exc}: {[tuple(r) for r in rows]}") from None


def _raise_limit(bootstrap: str, topic: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC, topic, configs={"max.message.bytes": "2000000"}
                )
            ]
        )
    finally:
        admin.close()
