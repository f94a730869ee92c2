"""Kafka Connect standalone with Debezium's PostgreSQL connector and its Outbox Event Router.

The jars listed in ``pom.xml`` (beside this file) come from Maven Central once, into a cache
folder keyed by the pom's content; ``settings.xml`` mirrors every repository to Central,
since Debezium's parent POM names another one. Connect runs them as one classpath: with a
single connector there is nothing for plugin.path isolation to separate.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from outbox.testing.processes import free_port
from outbox.testing.tools import java_executable, maven_executable

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
SETTINGS = HERE / "settings.xml"
MAIN = "org.apache.kafka.connect.cli.ConnectStandalone"

LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = org.apache.kafka
logger.kafka.level = WARN
"""


def jars_dir() -> Path:
    override = os.environ.get("OUTBOXKIT_DEBEZIUM_LIBS")
    if override:
        return Path(override)
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "outboxkit-bench" / f"debezium-jars-{digest}"


def ensure_jars() -> Path:
    """Fetch Connect's and Debezium's jars with Maven unless the cache holds them."""
    libs = jars_dir()
    if any(libs.glob("debezium-connector-postgres-*.jar")):
        return libs
    if os.environ.get("OUTBOXKIT_DEBEZIUM_LIBS"):
        raise SystemExit(f"OUTBOXKIT_DEBEZIUM_LIBS={libs} holds no debezium-connector-postgres jar")
    libs.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="jars-", dir=libs.parent))
    argv = [
        str(maven_executable()),
        "-q",
        "-B",
        "-s",
        str(SETTINGS),
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0 or not any(staging.glob("debezium-connector-postgres-*.jar")):
            said = (result.stdout + result.stderr).strip()[-3000:]
            raise SystemExit(
                "Maven could not fetch Kafka Connect's and Debezium's jars from Maven Central "
                f"(is the network or a proxy blocking it?). mvn said: {said}"
            )
        staging.rename(libs)  # whole folder at once: a half-fetched cache is never used
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return libs


@dataclass(frozen=True)
class Producer:
    """The producer settings both engines get (the relay's defaults, no compression)."""

    linger_ms: int
    batch_bytes: int
    max_request_bytes: int

    def connect_overrides(self) -> dict[str, str]:
        return {
            "producer.acks": "all",
            "producer.enable.idempotence": "true",
            "producer.max.in.flight.requests.per.connection": "5",
            "producer.linger.ms": str(self.linger_ms),
            "producer.batch.size": str(self.batch_bytes),
            "producer.compression.type": "none",
            "producer.max.request.size": str(self.max_request_bytes),
        }


def connector_config(
    *, host: str, port: int, dbname: str, slot: str, publication: str, topic_prefix: str,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """Debezium's PostgreSQL connector streaming ``outboxkit.outbox_messages`` through pgoutput
    from a slot and publication made beforehand, every row routed by its ``topic`` column."""
    return {
        "name": "outboxkit-bench-debezium",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "database.hostname": host,
        "database.port": str(port),
        "database.user": "postgres",
        "database.dbname": dbname,
        "topic.prefix": "dbzbench",
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "publication.name": publication,
        "publication.autocreate.mode": "disabled",
        # The rows are in the slot's WAL already: stream them, read no table.
        "snapshot.mode": "no_data",
        "table.include.list": "outboxkit.outbox_messages",
        # The columns the router reads (and the primary key): the others (the relay's xid,
        # headers, run_id, ...) are neither converted nor warned about.
        "column.include.list": ",".join(
            f"outboxkit.outbox_messages.{c}"
            for c in ("id", "message_id", "topic", "key", "message_type", "payload")
        ),
        "tombstones.on.delete": "false",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "transforms.outbox.route.by.field": "topic",
        # A topic apart from the relay's, so each engine's records are counted alone.
        "transforms.outbox.route.topic.replacement": f"{topic_prefix}${{routedByValue}}",
        "transforms.outbox.table.field.event.id": "message_id",
        "transforms.outbox.table.field.event.key": "key",
        "transforms.outbox.table.field.event.payload": "payload",
        # The relay's two headers; the latency phase reads message-id from either engine.
        "transforms.outbox.table.fields.additional.placement": (
            "message_id:header:message-id,message_type:header:message-type"
        ),
        **(extra or {}),
    }


def worker_config(
    *, bootstrap: str, offsets: Path, producer: Producer
) -> dict[str, str]:
    return {
        "bootstrap.servers": bootstrap,
        # Key and payload are bytea columns: their bytes go to Kafka unchanged, as the relay's.
        "key.converter": "org.apache.kafka.connect.converters.ByteArrayConverter",
        "value.converter": "org.apache.kafka.connect.converters.ByteArrayConverter",
        "offset.storage.file.filename": str(offsets),
        "listeners": f"http://127.0.0.1:{free_port()}",
        # Topics are made beforehand (6 partitions, LogAppendTime) like the relay's.
        "topic.creation.enable": "false",
        # Every jar here has ServiceLoader manifests (Connect says so and suggests this):
        # no scan of the whole classpath at start-up.
        "plugin.discovery": "service_load",
        **producer.connect_overrides(),
    }


def _properties(values: dict[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


class Connect:
    """One Kafka Connect standalone JVM running one connector; our child process."""

    def __init__(
        self, libs: Path, workdir: Path, name: str, worker: dict[str, str],
        connector: dict[str, str],
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        worker_file = workdir / f"{name}-worker.properties"
        connector_file = workdir / f"{name}-connector.properties"
        worker_file.write_text(_properties(worker))
        connector_file.write_text(_properties(connector))
        self.log_path = workdir / f"{name}.log"
        log4j = workdir / f"{name}-log4j2.properties"
        log4j.write_text(LOG4J2.format(log=self.log_path))
        self._out = (workdir / f"{name}.stdout").open("wb")
        argv = [
            str(java_executable()),
            # What Kafka's bin/connect-standalone.sh and kafka-run-class.sh give the JVM.
            "-Xms256M",
            "-Xmx2G",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            f"{libs}/*",
            MAIN,
            str(worker_file),
            str(connector_file),
        ]
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.proc = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"Kafka Connect exited with {self.proc.returncode}:\n{self.tail()}")
        # A failed task does not end the JVM; its stack trace is in the log.
        text = self.tail(20_000)
        if "Task threw an uncaught and unrecoverable exception" in text or (
            "ERROR" in text and "Failed to start task" in text
        ):
            raise RuntimeError(f"Debezium's task failed:\n{self.tail()}")

    def tail(self, size: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-size:]
        return ""

    def stop(self) -> None:
        """SIGTERM (Connect commits its offsets and stops the task), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._out.close()
