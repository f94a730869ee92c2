"""A real Apache Kafka 4.x broker in KRaft combined mode, run from Maven Central's jars.

No package ships the broker and these machines have no Docker engine, so the jars listed
in ``kafka/pom.xml`` are fetched once with Maven into a cache folder and run on Java 17+.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from outbox.errors import ServiceError
from outbox.testing.processes import ensure_port_free, pid_alive, port_open, stop_pid
from outbox.testing.tools import java_executable, maven_executable

LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
"""


PID_FILE = "broker.pid"
"""The broker's pid and nothing else, so ``kill $(cat broker.pid)`` signals just the broker."""
PORTS_FILE = "broker.json"
"""The broker's ports: ``{"port": ..., "controller_port": ...}``."""


# Brokers started by this process. Keeping the Popen objects alive stops Python from
# warning that a child is "still running" when they are garbage collected, on purpose.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class KafkaBroker:
    home: Path
    port: int
    controller_port: int
    pid: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


def pom_path() -> Path:
    return Path(str(resources.files("outbox.testing") / "kafka" / "pom.xml"))


def libs_dir() -> Path:
    """Where the broker's jars are cached, keyed by the pom's content."""
    override = os.environ.get("OUTBOXKIT_KAFKA_LIBS")
    if override:
        return Path(override)
    digest = hashlib.sha256(pom_path().read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "outboxkit" / f"kafka-jars-{digest}"


def ensure_jars() -> Path:
    """Fetch the broker's jars with Maven unless the cache already holds them."""
    libs = libs_dir()
    if any(libs.glob("kafka_2.13-*.jar")):
        return libs
    if os.environ.get("OUTBOXKIT_KAFKA_LIBS"):
        raise ServiceError(f"OUTBOXKIT_KAFKA_LIBS={libs} holds no kafka_2.13-*.jar")
    mvn = maven_executable()
    libs.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="jars-", dir=libs.parent))
    argv = [
        str(mvn),
        "-q",
        "-B",
        "-f",
        str(pom_path()),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]
    # For mirrors/proxies (and for testing the error when Maven Central is unreachable).
    if settings := os.environ.get("OUTBOXKIT_MAVEN_SETTINGS"):
        argv += ["-s", settings]
    if repo := os.environ.get("OUTBOXKIT_MAVEN_REPO_LOCAL"):
        argv.append(f"-Dmaven.repo.local={repo}")
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            output = (result.stdout + result.stderr).strip()[-3000:]
            raise ServiceError(
                "Maven could not download the Kafka broker's jars from Maven Central "
                f"(is the network or a proxy blocking it?). mvn said: {output}"
            )
        # Publish the whole folder at once so a half-fetched cache is never used.
        staging.rename(libs)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return libs


def _cluster_id() -> str:
    # URL-safe base64 of 16 random bytes, 22 characters; a leading '-' confuses the CLI.
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _write_config(
    home: Path,
    port: int,
    controller_port: int,
    *,
    node_id: int = 1,
    voters: str | None = None,
    settings: dict[str, str] | None = None,
) -> Path:
    """The node's server.properties. Called with three arguments, the single broker's, as
    before; a cluster's node passes its id, the static quorum (``controller.quorum.voters``,
    ``"1@127.0.0.1:port,..."``) and the settings that replace the single broker's (its
    replication factors of 1)."""
    data = home / "data"
    quorum = (
        ("controller.quorum.voters", voters)
        if voters
        else ("controller.quorum.bootstrap.servers", f"127.0.0.1:{controller_port}")
    )
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        quorum[0]: quorum[1],
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data),
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "num.network.threads": "2",
        "num.io.threads": "4",
        "log.retention.hours": "24",
    }
    props.update(settings or {})
    config = home / "server.properties"
    config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    (home / "log4j2.properties").write_text(LOG4J2.format(log=home / "server.log"))
    return config


def _java_argv(
    home: Path, libs: Path, main: str, *args: str, heap_mb: int | None = None
) -> list[str]:
    # A cluster's nodes get one small fixed heap each, so three JVMs fit beside the rest.
    heap = [f"-Xms{heap_mb}m", f"-Xmx{heap_mb}m"] if heap_mb else ["-Xms256m", "-Xmx768m"]
    return [
        str(java_executable()),
        *heap,
        "-XX:+UseG1GC",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={home / 'log4j2.properties'}",
        "-cp",
        f"{libs}/*",
        main,
        *args,
    ]


def _recorded(home: Path) -> tuple[int, int, int] | None:
    """The pid, port and controller port recorded in *home*, if any."""
    try:
        words = (home / PID_FILE).read_text().split()
        if len(words) == 3:
            # Written before one pid per file ("pid port controller_port"): brokers started
            # then are still running somewhere, and must still be found and stopped.
            pid, port, controller_port = (int(w) for w in words)
            return pid, port, controller_port
        if len(words) != 1:
            return None
        ports = json.loads((home / PORTS_FILE).read_text())
        return int(words[0]), int(ports["port"]), int(ports["controller_port"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def running_broker(home: Path) -> KafkaBroker | None:
    """The broker recorded in *home*, if it is still running and listening."""
    recorded = _recorded(home)
    if recorded is None:
        return None
    pid, port, controller_port = recorded
    if pid_alive(pid) and port_open(port):
        return KafkaBroker(home, port, controller_port, pid)
    return None


def start(
    home: Path, port: int, controller_port: int, *, ready_timeout_s: float = 60,
    settings: dict[str, str] | None = None,
) -> KafkaBroker:
    """A single broker (and its controller) in *home*; *settings* replace server.properties
    entries (a test's ``auto.create.topics.enable``, say)."""
    existing = running_broker(home)
    if existing:
        return existing
    java_executable()  # fail early, before fetching jars, when there is no Java
    libs = ensure_jars()
    ensure_port_free(port, "Kafka", "--kafka-port")
    ensure_port_free(controller_port, "Kafka's controller", "--kafka-controller-port")
    home.mkdir(parents=True, exist_ok=True)
    config = _write_config(home, port, controller_port, settings=settings)
    if not (home / "data" / "meta.properties").exists():
        shutil.rmtree(home / "data", ignore_errors=True)
        format_storage(home, libs, config, _cluster_id(), standalone=True)
    proc = launch(home, libs, config, port, controller_port)
    broker = KafkaBroker(home, port, controller_port, proc.pid)
    try:
        wait_ready(broker, timeout_s=ready_timeout_s)
    except ServiceError:
        abandon(home, proc)
        raise
    return broker


def format_storage(
    home: Path,
    libs: Path,
    config: Path,
    cluster_id: str,
    *,
    standalone: bool,
    heap_mb: int | None = None,
) -> None:
    """Write the node's meta.properties. ``standalone``: a quorum of this one node (KIP-853);
    a cluster's nodes name their voters in ``controller.quorum.voters`` instead."""
    flags = ["--standalone"] if standalone else []
    argv = _java_argv(
        home, libs, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config),
        *flags, heap_mb=heap_mb,
    )  # fmt: skip
    fmt = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if fmt.returncode != 0:
        raise ServiceError(f"formatting Kafka's storage failed: {fmt.stderr.strip()[-2000:]}")


def launch(
    home: Path,
    libs: Path,
    config: Path,
    port: int,
    controller_port: int,
    *,
    heap_mb: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start the node's JVM and record its pid and ports in *home*; not waiting for it."""
    out = (home / "stdout.log").open("ab")
    # A session of its own: the broker outlives the command that started it.
    proc = subprocess.Popen(
        _java_argv(home, libs, "kafka.Kafka", str(config), heap_mb=heap_mb),
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    out.close()
    _CHILDREN[proc.pid] = proc
    # Ports first: a pid file is only ever read with its ports already beside it.
    (home / PORTS_FILE).write_text(json.dumps({"port": port, "controller_port": controller_port}))
    (home / PID_FILE).write_text(f"{proc.pid}\n")
    return proc


def abandon(home: Path, proc: subprocess.Popen[bytes]) -> None:
    """Stop a node that did not become ready, and forget its pid."""
    stop_pid(proc.pid, grace_s=5)
    _CHILDREN.pop(proc.pid, None)
    proc.wait(timeout=5)
    (home / PID_FILE).unlink(missing_ok=True)


def forget(home: Path, pid: int) -> None:
    """Reap a node's process that has exited (ours) and drop its pid file, so a reused pid
    is never signalled by the next ``kill $(cat broker.pid)``."""
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        child.wait(timeout=5)
    recorded = _recorded(home)
    if recorded is not None and recorded[0] == pid:
        (home / PID_FILE).unlink(missing_ok=True)


def wait_ready(broker: KafkaBroker, *, timeout_s: float) -> None:
    """Ready means an admin client can list topics, not that a log line appeared."""
    from outbox.kafka import Connection, backend  # noqa: PLC0415

    client = backend("kafka-python", Connection(broker.bootstrap))

    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if not pid_alive(broker.pid):
            raise ServiceError(
                f"the Kafka broker exited during start-up; see {broker.home}/server.log "
                f"and {broker.home}/stdout.log:\n{_tail(broker.home)}"
            )
        if port_open(broker.port):
            try:
                admin = client.admin("outboxkit-ready", request_timeout_ms=5000)
                try:
                    admin.list_topics()
                    return
                finally:
                    admin.close()
            except Exception as exc:  # not up yet, whatever the client says
                last_error = exc
        time.sleep(0.2)
    raise ServiceError(
        f"the Kafka broker on {broker.bootstrap} was not ready within {timeout_s:.0f} s "
        f"(last error: {last_error!r}):\n{_tail(broker.home)}"
    )


def _tail(home: Path) -> str:
    parts = []
    for name in ("stdout.log", "server.log"):
        path = home / name
        if path.exists():
            parts.append(path.read_text(errors="replace")[-1500:])
    return "\n".join(parts)


def stop(home: Path, *, grace_s: float = 20.0) -> bool:
    broker = running_broker(home)
    if broker is None:
        return False
    stop_pid(broker.pid, grace_s=grace_s)
    child = _CHILDREN.pop(broker.pid, None)
    if child is not None:
        child.wait(timeout=5)
    # A stale pid could be another process's by the next ``kill $(cat broker.pid)``.
    (home / PID_FILE).unlink(missing_ok=True)
    return True
