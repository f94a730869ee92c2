"""`python -m outbox.testing.services up --brokers 3`: a 3-node KRaft cluster from the services
script, on nodes of its own. The exported bootstrap names every node, a topic made without
settings is production's (3 replicas, min.insync.replicas=2, no unclean election), one node
stopped by hand leaves acks=all working on the 2 in sync, a single broker and a cluster never
share a folder, and ``down`` stops every node by its pid."""

from __future__ import annotations

import json
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

from outbox.kafka import Connection, backend
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
        configs = admin.topic_configs(
            [topic], ["min.insync.replicas", "unclean.leader.election.enable"])
    finally:
        admin.close()
    assert configs[topic] == {"min.insync.replicas": "2", "unclean.leader.election.enable": "false"}
    cluster.wait_in_sync(topic, timeout_s=30)
    assert len(cluster.partition(topic).replicas) == 3
    produce_all_acks(bootstrap, topic, b"three in sync")

    # Stop the partition's leader by hand: acks=all goes on with the 2 left in sync.
    leader = cluster.leader(topic)
    assert main(["--dir", str(state), "stop", "kafka-node", str(leader)]) == 0
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

    # The folder is a cluster's: the single broker is refused, saying what to do.
    assert main(["--dir", str(state), "up"]) == 1
    assert "`down`" in capsys.readouterr().err

    assert main(["--dir", str(state), "start", "kafka-node", str(leader)]) == 0
    assert status(state, capsys)[0] == 0
    pids = [n.pid for n in cluster.nodes]

    assert main(["--dir", str(state), "down"]) == 0
    assert "kafka nodes 1, 2, 3" in capsys.readouterr().err
    assert not any(pid_alive(pid or 0) for pid in pids)
    assert status(state, capsys)[0] == 3
    print(f"up --brokers 3 took {took:.1f} s", file=sys.stderr)


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
