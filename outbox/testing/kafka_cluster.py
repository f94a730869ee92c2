"""A replicated Apache Kafka 4.x cluster of 3 KRaft nodes on loopback: production's topology.

Each node is a broker and a controller at once (combined mode) and a voter of one static
quorum (``controller.quorum.voters``); all share one cluster id. The replication defaults
are the recommended production ones: a topic made without settings has 3 replicas and
``min.insync.replicas=2``, so ``acks=all`` survives one node's death without losing what
it acknowledged, and no out-of-sync replica is ever elected (no unclean election).

Each node lives in ``home/node-<id>/``, laid out like the single broker's home
(:mod:`outbox.testing.kafka`: ``broker.pid`` holding the pid alone, ``broker.json`` its
ports, ``server.log``), and ``home/cluster.json`` records the cluster id and every node's
ports, so :func:`running_cluster` finds a started cluster again and :func:`stop_cluster`
stops every node by pid, from any process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.errors import ServiceError
from outbox.testing import kafka
from outbox.testing.processes import ensure_port_free, pid_alive, port_open, service_port
from outbox.testing.tools import java_executable

CLUSTER_FILE = "cluster.json"
"""``{"cluster_id": ..., "heap_mb": ..., "nodes": {"1": {"port": ..., "controller_port": ...}}}``"""


class _NodeExited(ServiceError):
    """A node died while we waited for it: waiting longer cannot help."""


@dataclass(frozen=True)
class KafkaNode:
    id: int
    port: int
    controller_port: int
    pid: int | None
    """None when the node's process is not running (killed, stopped, never started)."""
    home: Path
    paused: bool = False
    """SIGSTOPped: the process lives and its ports accept connections, but nothing answers."""

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(frozen=True)
class PartitionState:
    leader: int
    """-1 while the partition has no leader (no replica in sync is alive)."""
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


class KafkaCluster:
    """The nodes recorded in *home*. Every property reads the pid files again, so a node
    killed or restarted (by this object, another one or another process) shows as it is."""

    def __init__(self, home: Path) -> None:
        self.home = home
        recorded = _read_cluster_file(home)
        if recorded is None:
            raise ServiceError(f"{home} holds no Kafka cluster ({CLUSTER_FILE} is missing)")
        self.cluster_id = str(recorded["cluster_id"])
        self.heap_mb = int(recorded["heap_mb"])
        self._ports = {
            int(node_id): (int(p["port"]), int(p["controller_port"]))
            for node_id, p in recorded["nodes"].items()
        }

    @property
    def node_ids(self) -> list[int]:
        return sorted(self._ports)

    def node(self, node_id: int) -> KafkaNode:
        if node_id not in self._ports:
            raise ServiceError(f"the cluster in {self.home} has no node {node_id}")
        port, controller_port = self._ports[node_id]
        home = node_home(self.home, node_id)
        pid = _live_pid(home)
        return KafkaNode(
            node_id, port, controller_port, pid, home, pid is not None and _paused(pid)
        )

    @property
    def nodes(self) -> list[KafkaNode]:
        return [self.node(node_id) for node_id in self.node_ids]

    @property
    def bootstrap(self) -> str:
        """Every node, as clients are given it: they find the live ones themselves."""
        return ",".join(f"127.0.0.1:{self._ports[n][0]}" for n in self.node_ids)

    def live_bootstrap(self) -> str:
        """The nodes whose process runs and is not paused: a client bootstrapping from a
        SIGSTOPped node waits for its bootstrap timeout (30 s) before trying the next."""
        live = [n.bootstrap for n in self.nodes if n.pid is not None and not n.paused]
        if not live:
            raise ServiceError(f"no node of the Kafka cluster in {self.home} is running")
        return ",".join(live)

    # --- faults -------------------------------------------------------------------------

    def kill(self, node_id: int, sig: int = signal.SIGKILL) -> int:
        """Send *sig* to the node's process and return its pid. After SIGKILL this waits
        until the process is gone and drops its pid file, after SIGSTOP until it is stopped;
        any other signal (SIGCONT, SIGTERM) is only sent."""
        node = self.node(node_id)
        pid = node.pid
        if pid is None:
            raise ServiceError(f"Kafka node {node_id} is not running; nothing to signal")
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:  # the JVM's threads stop one after the other
            _wait_for(lambda: _paused(pid), 10, f"node {node_id} to stop")
        elif sig == signal.SIGKILL:
            _wait_dead(pid, f"node {node_id}")
            kafka.forget(node.home, pid)
        return pid

    def stop_node(self, node_id: int, *, grace_s: float = 30.0) -> bool:
        """Stop one node as an operator would (SIGTERM: a controlled shutdown that moves its
        leaderships away), SIGKILL after *grace_s*. False if it was not running."""
        node = self.node(node_id)
        if node.pid is None:
            return False
        _stop_pids({node_id: (node.home, node.pid)}, grace_s=grace_s)
        return True

    def restart(self, node_id: int, *, ready_timeout_s: float = 60.0) -> KafkaNode:
        """Stop the node if it runs (a SIGSTOPped one is continued first), start it again on
        its ports and data, and wait until the cluster counts it as an unfenced broker."""
        self.stop_node(node_id)
        libs = kafka.ensure_jars()
        port, controller_port = self._ports[node_id]
        home = node_home(self.home, node_id)
        _ensure_ports_free(node_id, port, controller_port)
        proc = kafka.launch(
            home, libs, home / "server.properties", port, controller_port, heap_mb=self.heap_mb
        )
        try:
            self.wait_ready([node_id], timeout_s=ready_timeout_s)
        except ServiceError:
            kafka.abandon(home, proc)
            raise
        return self.node(node_id)

    # --- what the cluster says ----------------------------------------------------------

    @contextlib.contextmanager
    def admin(self, request_timeout_ms: int = 5000) -> Iterator[Any]:
        """A kafka-python admin client on the live nodes, closed on leaving."""
        from kafka import KafkaAdminClient  # noqa: PLC0415

        client = KafkaAdminClient(
            bootstrap_servers=self.live_bootstrap(),
            client_id="outboxkit-cluster",
            request_timeout_ms=request_timeout_ms,
        )
        try:
            yield client
        finally:
            client.close()

    def brokers(self) -> set[int]:
        """The ids of the brokers registered and unfenced, as a running node's metadata
        says (DescribeCluster)."""
        from kafka.protocol.admin import DescribeClusterRequest  # noqa: PLC0415

        request = DescribeClusterRequest(
            include_cluster_authorized_operations=False, endpoint_type=1,
            include_fenced_brokers=True, version=2,
        )  # fmt: skip
        found = self._ask_a_broker(request)
        if found["error_code"]:
            raise ServiceError(f"DescribeCluster failed: {found}")
        return {int(b["broker_id"]) for b in found["brokers"] if not b["is_fenced"]}

    def active_controller(self, timeout_s: float = 2.0) -> int:
        """The KRaft quorum's leader, the active controller; -1 during an election.

        Each running node's controller listener is asked (DescribeQuorum): only the leader
        answers without an error. Not through a broker: ``describe_cluster``'s controller
        id is a random broker in KRaft, and a broker forwards DescribeQuorum to the
        controller it knew, so a SIGSTOPped old leader held its answers for 30 to 60 s here."""
        leaders = []
        for node in self.nodes:
            if node.pid is None or node.paused:
                continue
            with contextlib.suppress(Exception):  # going away: it leads nothing
                found = _describe_quorum(node.controller_port, timeout_s)
                if found is not None:
                    leaders.append(found)
        # A deposed leader may not know it yet: the highest epoch is the current one.
        return max(leaders)[1] if leaders else -1

    def partition(self, topic: str, partition: int = 0) -> PartitionState:
        """The partition's leader, replicas and in-sync replicas, as a running node's
        metadata says."""
        from kafka.protocol.metadata import MetadataRequest  # noqa: PLC0415

        request = MetadataRequest(
            topics=[MetadataRequest.MetadataRequestTopic(name=topic)],
            allow_auto_topic_creation=False, version=12,
        )  # fmt: skip
        for found in self._ask_a_broker(request)["topics"]:
            if found["name"] != topic or found["error_code"]:
                continue
            for part in found["partitions"]:
                if int(part["partition_index"]) == partition:
                    return PartitionState(
                        int(part["leader_id"]),
                        tuple(int(r) for r in part["replica_nodes"]),
                        tuple(int(r) for r in part["isr_nodes"]),
                    )
        raise ServiceError(f"the cluster knows no partition {topic}-{partition}")

    def _ask_a_broker(self, request: Any, timeout_s: float = 5.0) -> dict[str, Any]:
        """The answer of the first running, unpaused node that gives one. Asked on a plain
        socket, not through kafka-python's admin client: that one sends to any node of the
        metadata, a SIGSTOPped one included, and waits for it."""
        errors = []
        for node in self.nodes:
            if node.pid is None or node.paused:
                continue
            try:
                return _ask(node.port, request, timeout_s)
            except Exception as exc:  # going away, or a protocol error: ask the next
                errors.append(f"node {node.id}: {exc!r}")
        raise ServiceError(f"no node of the Kafka cluster in {self.home} answered: {errors}")

    def leader(self, topic: str, partition: int = 0) -> int:
        return self.partition(topic, partition).leader

    def create_topic(
        self,
        name: str,
        *,
        partitions: int = 1,
        replication_factor: int = -1,
        configs: Mapping[str, str] | None = None,
    ) -> None:
        """Create *name* (by default with the cluster's replication factor and
        ``min.insync.replicas``) and wait until every partition has a leader."""
        with self.admin(request_timeout_ms=30_000) as admin:
            admin.create_topics(
                {
                    name: {
                        "num_partitions": partitions,
                        "replication_factor": replication_factor,
                        "configs": dict(configs or {}),
                    }
                },
                timeout_ms=30_000,
                wait_for_metadata=True,
            )

    def wait_in_sync(self, topic: str, partition: int = 0, *, timeout_s: float = 60) -> float:
        """Wait until every replica of the partition is in sync (an ISR as large as its
        replica set, with a leader); returns the seconds it took."""
        started = time.monotonic()

        def in_sync() -> bool:
            state = self.partition(topic, partition)
            return state.leader >= 0 and set(state.isr) == set(state.replicas)

        _wait_for(
            in_sync, timeout_s, f"every replica of {topic}-{partition} to be in sync", self._tails
        )
        return time.monotonic() - started

    def wait_ready(self, node_ids: Sequence[int] | None = None, *, timeout_s: float) -> None:
        """Ready means a client sees each of *node_ids* (default: all) as an unfenced broker
        and the quorum has a leader, not that a log line appeared."""
        wanted = set(node_ids if node_ids is not None else self.node_ids)

        def ready() -> bool:
            for node in self.nodes:
                if node.id in wanted and node.pid is None:
                    raise _NodeExited(
                        f"Kafka node {node.id} exited during start-up; see {node.home}/"
                        f"server.log and stdout.log:\n{self._tails([node.id])}"
                    )
            if not all(port_open(self._ports[n][0]) for n in wanted):
                return False
            return wanted <= self.brokers() and self.active_controller() >= 0

        _wait_for(ready, timeout_s, f"Kafka nodes {sorted(wanted)} to be ready", self._tails)

    def _tails(self, node_ids: Sequence[int] | None = None) -> str:
        return "\n".join(
            f"--- node {n}:\n{kafka._tail(node_home(self.home, n))}"
            for n in (node_ids or self.node_ids)
        )


def node_home(home: Path, node_id: int) -> Path:
    return home / f"node-{node_id}"


def cluster_settings(
    nodes: int, *, replica_lag_time_max_ms: int, session_timeout_ms: int
) -> dict[str, str]:
    """What each node's server.properties holds beyond the single broker's: production's
    replication defaults (3 replicas, 2 in sync to acknowledge, no unclean election; fewer
    with fewer nodes) and the failure detection the fault tests measure."""
    replicas = min(3, nodes)
    in_sync = max(1, replicas - 1)
    return {
        "default.replication.factor": str(replicas),
        "min.insync.replicas": str(in_sync),
        "offsets.topic.replication.factor": str(replicas),
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": str(in_sync),
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": str(in_sync),
        "unclean.leader.election.enable": "false",
        # A follower that fetches nothing for this long leaves the ISR (default 30 s).
        "replica.lag.time.max.ms": str(replica_lag_time_max_ms),
        # A broker that sends no heartbeat for this long is fenced and its partitions get
        # new leaders: it bounds how long a SIGKILLed leader blocks producers (default 9 s).
        "broker.session.timeout.ms": str(session_timeout_ms),
        "broker.heartbeat.interval.ms": str(max(250, session_timeout_ms // 6)),
        # The log cleaner allocates its dedupe buffer (128 MB by default) at start-up: in a
        # node's small test heap that failed once with "Java heap space" under load. The
        # compacted topics here (consumer offsets) are tiny.
        "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
    }


def start_cluster(
    home: Path,
    *,
    nodes: int = 3,
    ports: Sequence[tuple[int, int]] | None = None,
    heap_mb: int = 256,
    replica_lag_time_max_ms: int = 10_000,
    session_timeout_ms: int = 6_000,
    settings: Mapping[str, str] | None = None,
    ready_timeout_s: float = 120.0,
) -> KafkaCluster:
    """Start (or reuse) a cluster of *nodes* combined broker+controller nodes in *home*.

    *ports* is each node's ``(port, controller_port)``, free ones by default. A cluster
    already recorded in *home* keeps its ports, id and data: its nodes that do not run are
    started again, and the ones that do are reused. *settings* override any node setting.
    """
    if not 1 <= nodes <= 9:
        raise ServiceError(f"a local Kafka cluster has 1 to 9 nodes, not {nodes}")
    if ports is not None and len(ports) != nodes:
        raise ServiceError(f"{len(ports)} port pairs given for {nodes} nodes")
    java_executable()  # fail early, before fetching jars, when there is no Java
    libs = kafka.ensure_jars()
    home.mkdir(parents=True, exist_ok=True)
    cluster = _recorded_or_new(home, nodes, ports, heap_mb)
    voters = ",".join(f"{n}@127.0.0.1:{cluster._ports[n][1]}" for n in cluster.node_ids)
    node_settings = {
        **cluster_settings(
            nodes,
            replica_lag_time_max_ms=replica_lag_time_max_ms,
            session_timeout_ms=session_timeout_ms,
        ),
        **(settings or {}),
    }
    to_start = [n.id for n in cluster.nodes if n.pid is None]
    if not to_start:
        return cluster
    for node_id in to_start:
        _ensure_ports_free(node_id, *cluster._ports[node_id])
    configs = {}
    for node_id in to_start:
        nhome = node_home(home, node_id)
        nhome.mkdir(parents=True, exist_ok=True)
        configs[node_id] = kafka._write_config(
            nhome,
            *cluster._ports[node_id],
            node_id=node_id,
            voters=voters,
            settings=node_settings,
        )
    _format_new_nodes(cluster, libs, configs)
    launched = {
        node_id: kafka.launch(
            node_home(home, node_id),
            libs,
            configs[node_id],
            *cluster._ports[node_id],
            heap_mb=cluster.heap_mb,
        )
        for node_id in to_start
    }
    try:
        cluster.wait_ready(timeout_s=ready_timeout_s)
    except ServiceError:
        for node_id, proc in launched.items():
            kafka.abandon(node_home(home, node_id), proc)
        raise
    return cluster


def running_cluster(home: Path) -> KafkaCluster | None:
    """The cluster recorded in *home* if at least one of its nodes runs (see ``.nodes`` for
    which), else None."""
    if _read_cluster_file(home) is None:
        return None
    cluster = KafkaCluster(home)
    return cluster if any(n.pid is not None for n in cluster.nodes) else None


def stop_cluster(home: Path, *, grace_s: float = 30.0) -> list[int]:
    """Stop every node recorded in *home* by its pid, all at once (SIGTERM; SIGKILL after
    *grace_s*), and return the ids of those that were running. Data is kept."""
    if _read_cluster_file(home) is None:
        return []
    cluster = KafkaCluster(home)
    running = {n.id: (n.home, n.pid) for n in cluster.nodes if n.pid is not None}
    _stop_pids(running, grace_s=grace_s)
    return sorted(running)


# --- internals ------------------------------------------------------------------------


def _read_cluster_file(home: Path) -> dict[str, Any] | None:
    try:
        recorded = json.loads((home / CLUSTER_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) and recorded.get("nodes") else None


def _recorded_or_new(
    home: Path, nodes: int, ports: Sequence[tuple[int, int]] | None, heap_mb: int
) -> KafkaCluster:
    recorded = _read_cluster_file(home)
    if recorded is not None:
        cluster = KafkaCluster(home)
        if len(cluster.node_ids) != nodes:
            raise ServiceError(
                f"{home} holds a Kafka cluster of {len(cluster.node_ids)} nodes, not {nodes}; "
                "stop it and delete the folder, or use another one"
            )
        if ports is not None and [cluster._ports[n] for n in cluster.node_ids] != [
            tuple(p) for p in ports
        ]:
            raise ServiceError(
                f"the Kafka cluster in {home} was made with other ports "
                f"({cluster._ports}); stop it and delete the folder to change them"
            )
        return cluster
    pairs = list(ports) if ports is not None else _free_port_pairs(nodes)
    (home / CLUSTER_FILE).write_text(
        json.dumps(
            {
                "cluster_id": kafka._cluster_id(),
                "heap_mb": heap_mb,
                "nodes": {
                    str(i): {"port": port, "controller_port": controller_port}
                    for i, (port, controller_port) in enumerate(pairs, start=1)
                },
            }
        )
    )
    return KafkaCluster(home)


def _free_port_pairs(nodes: int) -> list[tuple[int, int]]:
    """Distinct free ports: the kernel may hand out a just-released port twice."""
    seen: set[int] = set()
    while len(seen) < 2 * nodes:
        seen.add(service_port())
    flat = sorted(seen)
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(nodes)]


def _ensure_ports_free(node_id: int, port: int, controller_port: int) -> None:
    ensure_port_free(port, f"Kafka node {node_id}", "other ports (ports=...)")
    ensure_port_free(
        controller_port, f"Kafka node {node_id}'s controller", "other ports (ports=...)"
    )


def _format_new_nodes(cluster: KafkaCluster, libs: Path, configs: Mapping[int, Path]) -> None:
    """Format, side by side (each is a JVM start), the nodes that hold no data yet."""
    new = [
        n for n in configs if not (node_home(cluster.home, n) / "data" / "meta.properties").exists()
    ]

    def format_one(node_id: int) -> None:
        nhome = node_home(cluster.home, node_id)
        kafka.format_storage(
            nhome, libs, configs[node_id], cluster.cluster_id, standalone=False, heap_mb=64
        )

    with ThreadPoolExecutor(max_workers=max(1, len(new))) as pool:
        for future in [pool.submit(format_one, n) for n in new]:
            future.result()


def _live_pid(home: Path) -> int | None:
    """The recorded pid if its process lives, listening or not (starting, or SIGSTOPped)."""
    recorded = kafka._recorded(home)
    if recorded is not None and pid_alive(recorded[0]):
        return recorded[0]
    return None


def _paused(pid: int) -> bool:
    """True if the process is stopped (SIGSTOP): state T in /proc/<pid>/stat (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) S ...": comm may hold spaces and parentheses, so split after the last ')'.
    return stat.rsplit(")", 1)[-1].split()[:1] == ["T"]


def _describe_quorum(controller_port: int, timeout_s: float) -> tuple[int, int] | None:
    """(leader epoch, leader id) if the controller on *controller_port* is the quorum's
    leader, else None. kafka-python's clients cannot bootstrap from a controller listener
    (it answers no Metadata), hence the plain socket."""
    from kafka.protocol.admin import DescribeQuorumRequest  # noqa: PLC0415

    topic = DescribeQuorumRequest.TopicData
    request = DescribeQuorumRequest(
        topics=[topic(topic_name="__cluster_metadata",
                      partitions=[topic.PartitionData(partition_index=0)])],
        version=1,
    )  # fmt: skip
    answer = _ask(controller_port, request, timeout_s)
    partition = answer["topics"][0]["partitions"][0]
    if answer["error_code"] or partition["error_code"]:
        return None  # NOT_LEADER_OR_FOLLOWER: a follower, or a candidate during an election
    return int(partition["leader_epoch"]), int(partition["leader_id"])


def _ask(port: int, request: Any, timeout_s: float) -> dict[str, Any]:
    """Send one request (a kafka-python protocol message) to 127.0.0.1:*port* on a socket
    of its own and return the decoded answer; OSError if none comes within *timeout_s*."""
    from kafka.protocol.parser import KafkaProtocol  # noqa: PLC0415

    protocol = KafkaProtocol(client_id="outboxkit-cluster")
    protocol.send_request(request)
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(protocol.send_bytes())
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"127.0.0.1:{port} closed the connection")
            responses = protocol.receive_bytes(data)
            if responses:
                return dict(responses[0][1].to_dict())


def _stop_pids(running: Mapping[int, tuple[Path, int | None]], *, grace_s: float) -> None:
    pids = {node_id: pid for node_id, (_, pid) in running.items() if pid is not None}
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a SIGSTOPped JVM would never handle SIGTERM
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    for pid in pids.values():
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for node_id, pid in pids.items():
        _wait_dead(pid, f"node {node_id}")
        kafka.forget(running[node_id][0], pid)


def _wait_dead(pid: int, what: str) -> None:
    _wait_for(lambda: not pid_alive(pid), 10, f"{what} (pid {pid}) to exit")


def _wait_for(
    done: Callable[[], bool],
    timeout_s: float,
    what: str,
    tails: Callable[[], str] | None = None,
) -> None:
    """Poll *done* until true; a client error while nodes come and go counts as not yet."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if done():
                return
        except _NodeExited:
            raise
        except Exception as exc:  # not there yet, whatever the client (or a node) says
            last_error = exc
        time.sleep(0.2)
    detail = f" (last error: {last_error!r})" if last_error else ""
    raise ServiceError(
        f"timed out after {timeout_s:.0f} s waiting for {what}{detail}"
        + (f":\n{tails()}" if tails else "")
    )
