"""The local 3-node KRaft cluster (outbox.testing.kafka_cluster) is production's topology:
a topic is replicated 3 times with min.insync.replicas=2; the SIGKILLed leader of a
partition costs seconds of publishing with acks=all and no acknowledged record; the killed
node rejoins the ISR; the cluster is found again from its folder and stopped by pid.

One test, one cluster: ``make test`` spreads tests over workers one by one (--dist load),
so the steps of this story share a cluster only inside one test.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from kafka import KafkaConsumer
from kafka import TopicPartition as KafkaTopicPartition

from outbox.kafka import Connection, ConsumerOptions, Outgoing, ProducerOptions, backend
from outbox.testing.kafka_cluster import (
    KafkaCluster,
    running_cluster,
    start_cluster,
    stop_cluster,
)
from outbox.testing.processes import pid_alive
from relay import publisher as relay_publisher
from relay.publisher import under_replicated
from relay.settings import RelaySettings

BATCH = 10
HUNG_FOR_S = 28  # how long the leader stays SIGSTOPped at most


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    home = tmp_path_factory.mktemp("kafka-cluster")
    started = time.monotonic()
    try:
        found = start_cluster(home, ready_timeout_s=75)
        print(f"\n3-node cluster ready in {time.monotonic() - started:.1f} s")
        yield found
    finally:
        stop_cluster(home, grace_s=10)  # stops whatever a failed test left running


@dataclass
class Publisher:
    """Sends numbered records in batches with acks=all (the relay's producer), each batch
    awaited, until stopped; remembers when each batch was sent and acknowledged."""

    cluster: KafkaCluster
    topic: str
    acked: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    batches: list[tuple[float, float, bool]] = field(default_factory=list)  # sent, done, ok
    stop: threading.Event = field(default_factory=threading.Event)
    start: int = 0  # the first number sent

    def run(self) -> None:
        connection = Connection(self.cluster.bootstrap)
        producer = backend("kafka-python", connection).producer(
            ProducerOptions(client_id="cluster-test", delivery_timeout_ms=60_000)
        )
        n = self.start
        try:
            while not self.stop.is_set():
                values = list(range(n, n + BATCH))
                n += BATCH
                sent = time.monotonic()
                records = [Outgoing(self.topic, b"k", str(v).encode(), []) for v in values]
                deliveries = producer.send(records, timeout_s=60)
                ok = all(d.ok for d in deliveries)
                self.batches.append((sent, time.monotonic(), ok))
                for v, d in zip(values, deliveries, strict=True):
                    (self.acked if d.ok else self.failed).append(v)
        finally:
            producer.close()

    def wait_acked(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < count:
            assert time.monotonic() < deadline, f"only {len(self.acked)} of {count} acked"
            time.sleep(0.05)


def consume_all(cluster: KafkaCluster, topic: str, expected: set[int]) -> list[int]:
    """Every record of partition 0 from the start, until *expected* are all read."""
    consumer = KafkaConsumer(bootstrap_servers=cluster.bootstrap, enable_auto_commit=False)
    partition = KafkaTopicPartition(topic, 0)
    consumer.assign([partition])
    consumer.seek_to_beginning(partition)
    values: list[int] = []
    deadline = time.monotonic() + 30
    try:
        while not expected <= set(values) and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                values.extend(int(r.value) for r in records)
    finally:
        consumer.close()
    return values


def cluster_partitions(cluster: KafkaCluster, topic: str) -> set[int]:
    consumer = KafkaConsumer(bootstrap_servers=cluster.bootstrap.split(","))
    try:
        return set(consumer.partitions_for_topic(topic) or ())
    finally:
        consumer.close()


def partitions_while_a_node_is_dead(cluster: KafkaCluster, topic: str, group: str) -> set[int]:
    """As the consumer runner learns a topic at start-up: asks again while unknown."""
    consumer = backend("kafka-python", Connection(cluster.bootstrap)).consumer(
        ConsumerOptions(group_id=group, client_id=group)
    )
    try:
        deadline = time.monotonic() + 10
        while not (found := consumer.partitions_for_topic(topic)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return found or set()
    finally:
        consumer.close()


def test_a_replicated_cluster_loses_nothing_acknowledged_when_a_leader_is_killed(
    cluster: KafkaCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # The cluster forms: three brokers seen by a client, a quorum leader among them.
    assert cluster.brokers() == {1, 2, 3}
    controller = cluster.active_controller()
    assert controller in {1, 2, 3}
    assert len(cluster.bootstrap.split(",")) == 3
    pids = {n.id: n.pid for n in cluster.nodes}
    for node in cluster.nodes:
        assert node.pid is not None
        assert (node.home / "broker.pid").read_text().strip() == str(node.pid)

    # A topic with 3 replicas, 2 of them needed in sync to acknowledge.
    topic = f"cluster-{uuid.uuid4().hex[:8]}"
    cluster.create_topic(topic, replication_factor=3, configs={"min.insync.replicas": "2"})
    cluster.wait_in_sync(topic, timeout_s=30)
    before = cluster.partition(topic)
    assert len(before.replicas) == 3
    assert set(before.isr) == {1, 2, 3}
    # What the relay checks after creating a topic (it warns below 3 replicas on 3 brokers).
    for name in ("kafka-python", "confluent"):
        admin = backend(name, Connection(cluster.bootstrap)).admin("cluster-test")
        try:
            assert admin.replication(topic) == (3, 3), name
            single = f"single-{name}-{uuid.uuid4().hex[:6]}"
            admin.create_topic(single, 1, 1)
            deadline = time.monotonic() + 10  # until the node asked has the new topic
            # Each call may ask another node, which may not have the topic yet: the
            # assertions use the answer that ended the wait.
            while (single_rep := admin.replication(single))[0] == 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert single_rep == (1, 3), name
            assert under_replicated(*single_rep)
            assert not under_replicated(*admin.replication(topic))
            admin.delete_topics([single])
        finally:
            admin.close()
    # The relay says so when a topic it created got fewer replicas than the cluster allows
    # (Apache Kafka's default.replication.factor is 1; here the relay asks for 1).
    lonely = f"lonely-{uuid.uuid4().hex[:6]}"
    relay = relay_publisher.Publisher(
        RelaySettings(kafka_bootstrap=cluster.bootstrap, topic_replication=1)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="relay.publisher"):
            assert relay.missing_topics([lonely]) == {}
    finally:
        relay.close()
    warned = [r.getMessage() for r in caplog.records
              if getattr(r, "event", "") == "relay.topic_under_replicated"]
    assert warned == [f"topic {lonely} was created with 1 replica(s) on a cluster of 3 brokers: "
                      "one broker's loss can lose its messages. Set default.replication.factor=3 "
                      "and min.insync.replicas=2 on the brokers (or "
                      "OUTBOXKIT_RELAY_TOPIC_REPLICATION), then reassign this topic's replicas"]

    # Publishing with acks=all goes on across the SIGKILL of the partition's leader.
    before_partitions = cluster_partitions(cluster, topic)
    publisher = Publisher(cluster, topic)
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    try:
        publisher.wait_acked(200, timeout_s=30)
        leader = before.leader
        killed_at = time.monotonic()
        cluster.kill(leader, signal.SIGKILL)
        assert not pid_alive(pids[leader] or 0)
        acked_at_kill = len(publisher.acked)
        # Consumers starting now, with the dead node still in the metadata until its
        # session ends, learn the topic's partitions from a live node (kafka-python used to
        # raise ECONNREFUSED when it asked the dead one: the consumer exited at start-up).
        learnt = [partitions_while_a_node_is_dead(cluster, topic, f"late-{i}") for i in range(6)]
        assert learnt == [set(range(len(before_partitions)))] * 6, learnt
        publisher.wait_acked(acked_at_kill + 200, timeout_s=40)
    finally:
        publisher.stop.set()
        thread.join(timeout=70)
    assert not thread.is_alive()
    after_kill = [done for sent, done, ok in publisher.batches if sent >= killed_at and ok]
    resumed_s = min(after_kill) - killed_at
    gap_s = max(b[1] - a[1] for a, b in itertools.pairwise(publisher.batches))
    new_leader = cluster.leader(topic)
    print(
        f"killed leader {leader} (active controller: {controller}); acks=all resumed "
        f"{resumed_s:.1f} s after the SIGKILL (longest gap between acks {gap_s:.1f} s); "
        f"new leader {new_leader}; {len(publisher.acked)} acked, {len(publisher.failed)} "
        "failed"
    )
    assert resumed_s <= 15
    assert new_leader in set(before.replicas) - {leader}

    # Nothing acknowledged is lost, nothing is doubled, the order is kept.
    consumed = consume_all(cluster, topic, set(publisher.acked))
    assert set(publisher.acked) <= set(consumed), sorted(set(publisher.acked) - set(consumed))
    assert consumed == sorted(set(consumed)), "duplicates or out of order"

    # The killed node comes back on its ports and data and rejoins the ISR.
    restarted_at = time.monotonic()
    node = cluster.restart(leader, ready_timeout_s=45)
    assert node.pid is not None
    assert node.pid != pids[leader]
    rejoin_s = cluster.wait_in_sync(topic, timeout_s=30)
    print(
        f"node {leader} restarted and back in the ISR in "
        f"{time.monotonic() - restarted_at:.1f} s (ISR wait {rejoin_s:.1f} s)"
    )
    assert set(cluster.partition(topic).isr) == {1, 2, 3}

    # A leader that hangs (SIGSTOP: alive, its connections open, silent) is fenced after the
    # broker session; the producer gives up on the request it sent there after
    # request_timeout_ms and finds the new leader, instead of waiting for the node to wake.
    hung = cluster.leader(topic)
    publisher = Publisher(cluster, topic, start=len(publisher.acked) + len(publisher.failed))
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    try:
        publisher.wait_acked(BATCH * 5, timeout_s=30)
        stopped_at = time.monotonic()
        cluster.kill(hung, signal.SIGSTOP)
        try:
            acked_at_stop = len(publisher.acked)
            with contextlib.suppress(AssertionError):  # measured below
                publisher.wait_acked(acked_at_stop + BATCH * 5, timeout_s=HUNG_FOR_S)
            resumed = [done for sent, done, ok in publisher.batches if ok and done > stopped_at + 1]
        finally:
            cluster.kill(hung, signal.SIGCONT)
        publisher.wait_acked(len(publisher.acked) + BATCH, timeout_s=30)
    finally:
        publisher.stop.set()
        thread.join(timeout=70)
    hung_s = (min(resumed) - stopped_at) if resumed else float("inf")
    print(f"leader {hung} SIGSTOPped: acks=all resumed {hung_s:.1f} s later, leader now "
          f"{cluster.leader(topic)} (request timeout {ProducerOptions('x').request_timeout_ms} ms)")
    # One request timeout (10 s), or two when the retry still went to the hung node (20.2 s
    # once under CI's load); with the clients' 30 s it waits for the node to wake.
    assert hung_s <= 25, f"publishing waited for the hung leader ({HUNG_FOR_S} s)"
    cluster.wait_in_sync(topic, timeout_s=30)

    # Another process finds the started cluster from its folder alone, and starting it
    # again reuses the running nodes.
    assert [n.pid for n in start_cluster(cluster.home).nodes] == [n.pid for n in cluster.nodes]
    found = running_cluster(cluster.home)
    assert found is not None
    assert found.bootstrap == cluster.bootstrap
    live = {n.id: n.pid for n in found.nodes}
    assert all(live.values())
    assert live[leader] == node.pid
    shell = subprocess.run(
        ["sh", "-c", " && ".join(f"kill -0 $(cat {n.home / 'broker.pid'})" for n in found.nodes)],
        capture_output=True, text=True, timeout=10, check=False,
    )  # fmt: skip
    assert shell.returncode == 0, shell.stderr

    # stop_cluster stops all three by pid.
    stopping = time.monotonic()
    assert stop_cluster(cluster.home) == [1, 2, 3]
    print(f"cluster stopped in {time.monotonic() - stopping:.1f} s")
    assert not any(pid_alive(pid) for pid in live.values() if pid)
    assert running_cluster(cluster.home) is None
    assert all(not (n.home / "broker.pid").exists() for n in found.nodes)
