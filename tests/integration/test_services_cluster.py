"""`python -m outbox.testing.services up --brokers 3`: a 3-node KRaft cluster from the services
script, on nodes of its own. The exported bootstrap names every node, a topic made without
settings is production's (3 replicas, min.insync.replicas=2, no unclean election), and so is
the topic the relay makes on the exported variables; one node stopped by hand leaves acks=all
and the relay working on the 2 in sync, a single broker and a cluster never share a folder,
and ``down`` stops every node by its pid."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaProducer
from sqlalchemy import Engine, create_engine

from outbox import Envelope
from outbox.db.dsn import sqlalchemy_url
from outbox.db.migrate import migrate
from outbox.kafka import Admin, Connection, TopicPartition, backend
from outbox.messages.emit import emit
from outbox.testing.kafka_cluster import KafkaCluster
from outbox.testing.processes import pid_alive, stop_pid
from outbox.testing.services import LocalServices, main


@pytest.fixture
def state() -> Iterator[Path]:
    """A folder the unprivileged PostgreSQL owner can enter (pytest's tmp_path is not)."""
    folder = Path(tempfile.mkdtemp(prefix="services-cluster-"))
    folder.chmod(0o755)
    try:
        yield folder / "services"
    finally:
        main(["--dir", str(folder / "services"), "down"])  # whatever the test did
        shutil.rmtree(folder, ignore_errors=True)


def exports(stdout: str) -> dict[str, str]:
    pairs = (line.removeprefix("export ").split("=", 1) for line in stdout.splitlines())
    return dict(pairs)


def status(state: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, object]]:
    """``status``'s exit code and its lines, by name (None: "not running")."""
    capsys.readouterr()
    code = main(["--dir", str(state), "status"])
    lines: dict[str, object] = {}
    for line in capsys.readouterr().out.splitlines():
        name, _, info = line.partition(" {")
        if info:
            lines[name.strip()] = json.loads("{" + info)
        else:
            lines[line.removesuffix("not running").strip()] = None
    return code, lines


def produce_all_acks(bootstrap: str, topic: str, value: bytes) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), acks="all", retries=20,
                             request_timeout_ms=10_000, max_block_ms=30_000)
    try:
        producer.send(topic, value).get(timeout=30)
    finally:
        producer.close(timeout=5)


def topic_configs(admin: Admin, topic: str) -> dict[str, str] | None:
    """The topic's settings that decide what acks=all keeps. Bounded retries: the node asked
    may not know a topic made a moment ago (no entry, None) yet."""
    deadline = time.monotonic() + 15
    while True:
        found = admin.topic_configs(
            [topic], ["min.insync.replicas", "unclean.leader.election.enable"])[topic]
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def start_relay(exported: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """The relay as a user starts it in a shell configured by ``eval "$(... up)"``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "relay"], env={**env, **exported},
                                stdout=out, stderr=subprocess.STDOUT)


def stop_relay(relay: subprocess.Popen[bytes]) -> None:
    relay.terminate()
    try:
        relay.wait(timeout=30)
    except subprocess.TimeoutExpired:
        relay.kill()
        relay.wait(timeout=10)


def wait_published(bootstrap: str, topic: str, count: int, log: Path) -> None:
    """Until *count* records are in *topic* (its 6 partitions, the relay's default)."""
    admin = backend("kafka-python", Connection(bootstrap)).admin("services-test", 10_000)
    deadline = time.monotonic() + 45
    found: object = None
    try:
        while time.monotonic() < deadline:
            try:
                found = admin.end_offsets([TopicPartition(topic, p) for p in range(6)])
                if sum(found.values()) >= count:
                    return
            except Exception as exc:  # not created yet, or a leader moving
                found = exc
            time.sleep(0.3)
    finally:
        admin.close()
    raise AssertionError(f"{count} records not in {topic} ({found!r}); the relay said:\n"
                         + log.read_text(errors="replace")[-3000:])


def emit_one(engine: Engine, topic: str, n: int) -> None:
    with engine.begin() as conn:
        emit(conn, Envelope(topic=topic, type="probe", key=f"k{n}", payload={"n": n}))


@pytest.mark.timeout(120)
def test_up_brokers_3_runs_a_replicated_cluster_that_survives_a_node_stopped_by_hand(
        state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert main(["--dir", str(state), "up", "--brokers", "3"]) == 0
    took = time.monotonic() - started
    found = exports(capsys.readouterr().out)
    bootstrap = found["OUTBOXKIT_KAFKA_BOOTSTRAP"]
    assert found["OUTBOXKIT_TEST_KAFKA_BOOTSTRAP"] == bootstrap
    assert len(bootstrap.split(",")) == 3, bootstrap
    cluster = KafkaCluster(LocalServices(state).kafka_cluster_home)
    pids = [n.pid for n in cluster.nodes]
    assert all(pid is not None and pid_alive(pid) for pid in pids)

    code, lines = status(state, capsys)
    assert code == 0, lines
    nodes = {name: info for name, info in lines.items() if name.startswith("kafka node")}
    assert len(nodes) == 3
    assert all(isinstance(i, dict) and i["state"] == "alive" for i in nodes.values())
    controllers = [int(n.rsplit(" ", 1)[1]) for n, i in nodes.items()
                   if isinstance(i, dict) and i["controller"]]
    summary = lines["kafka"]
    assert isinstance(summary, dict)
    assert controllers == [summary["controller"]]

    # A topic made through the exported bootstrap without settings, as the relay's admin does.
    topic = f"cluster-{uuid.uuid4().hex[:8]}"
    admin = backend("kafka-python", Connection(bootstrap)).admin("services-test", 30_000)
    try:
        admin.create_topic(topic, 1)
        cluster.wait_in_sync(topic, timeout_s=30)
        configs = topic_configs(admin, topic)
    finally:
        admin.close()
    assert configs == {"min.insync.replicas": "2", "unclean.leader.election.enable": "false"}
    assert len(cluster.partition(topic).replicas) == 3
    produce_all_acks(bootstrap, topic, b"three in sync")

    # The relay, on the exported variables, creates its topic replicated 3 times as well.
    engine = create_engine(sqlalchemy_url(found["OUTBOXKIT_DATABASE_URL"]))
    migrate(engine)
    relayed = f"relayed-{uuid.uuid4().hex[:8]}"
    relay_log = state / "relay.log"
    relay = start_relay(found, relay_log)
    try:
        emit_one(engine, relayed, 1)
        wait_published(bootstrap, relayed, 1, relay_log)
        assert found["OUTBOXKIT_RELAY_TOPIC_REPLICATION"] == "3"
        assert len(cluster.partition(relayed).replicas) == 3
        figures = _relay_carries_on_with_a_node_stopped(
            state, cluster, topic, relayed, engine=engine, capsys=capsys)
    finally:
        stop_relay(relay)
        engine.dispose()
    node_pids = [n.pid for n in cluster.nodes]

    assert main(["--dir", str(state), "down"]) == 0
    assert "kafka nodes 1, 2, 3" in capsys.readouterr().err
    assert not any(pid_alive(pid or 0) for pid in node_pids)
    assert status(state, capsys)[0] == 3
    print(f"up --brokers 3: {took:.1f} s; {figures}", file=sys.stderr)


def _relay_carries_on_with_a_node_stopped(
        state: Path, cluster: KafkaCluster, topic: str, relayed: str, *, engine: Engine,
        capsys: pytest.CaptureFixture[str]) -> str:
    """Stop the leader of *topic* by hand: acks=all and the relay go on; start it again.
    Returns the figures measured."""
    bootstrap = cluster.bootstrap
    pids = [n.pid for n in cluster.nodes]
    # Stop the partition's leader by hand: acks=all goes on with the 2 left in sync.
    leader = cluster.leader(topic)
    stopping = time.monotonic()
    assert main(["--dir", str(state), "stop", "kafka-node", str(leader)]) == 0
    stopped = time.monotonic()
    assert not pid_alive(pids[leader - 1] or 0)
    code, lines = status(state, capsys)
    assert code == 3
    assert lines[f"kafka node {leader}"] == {
        "pid": None, "port": cluster.node(leader).port, "state": "not running",
        "controller": False}
    produce_all_acks(bootstrap, topic, b"two in sync")
    state_now = cluster.partition(topic)
    assert len(state_now.isr) == 2, state_now
    assert leader not in state_now.isr
    emit_one(engine, relayed, 2)  # and the relay goes on publishing
    emitted = time.monotonic()
    wait_published(bootstrap, relayed, 2, state / "relay.log")
    figures = (f"stop kafka-node {leader}: {stopped - stopping:.1f} s; the relay published the "
               f"next message {time.monotonic() - emitted:.2f} s after its commit")

    # The folder is a cluster's: the single broker is refused, saying what to do.
    assert main(["--dir", str(state), "up"]) == 1
    assert "`down`" in capsys.readouterr().err

    restarting = time.monotonic()
    assert main(["--dir", str(state), "start", "kafka-node", str(leader)]) == 0
    assert status(state, capsys)[0] == 0
    return f"{figures}; start kafka-node {leader}: {time.monotonic() - restarting:.1f} s"


def test_a_cluster_is_refused_while_the_single_broker_of_the_folder_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A stand-in for the single broker: what the folder records (a live pid, an open port)
    # is all the check reads, and no JVM has to start for it.
    stand_in = subprocess.Popen(
        [sys.executable, "-c", "import socket, time; s = socket.socket(); "
         "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert stand_in.stdout is not None
        port = int(stand_in.stdout.readline())
        state = tmp_path / "services"
        home = LocalServices(state).kafka_home
        home.mkdir(parents=True)
        (home / "broker.json").write_text(json.dumps({"port": port, "controller_port": 1}))
        (home / "broker.pid").write_text(f"{stand_in.pid}\n")
        assert main(["--dir", str(state), "up", "--brokers", "3"]) == 1
        error = capsys.readouterr().err
        assert "single Kafka broker runs" in error
        assert "`down`" in error
        assert not (state / "kafka-cluster").exists()  # refused before starting anything
        assert not LocalServices(state).postgres_dir.exists()
    finally:
        stop_pid(stand_in.pid, grace_s=5)
        stand_in.wait(timeout=5)
        if stand_in.stdout is not None:
            stand_in.stdout.close()
