"""pytest plugin: real PostgreSQL and Kafka for outboxkit's tests and for yours.

Registered through the ``pytest11`` entry point, so installing outboxkit makes these
fixtures available. Where the services come from, in order of preference:

1. ``OUTBOXKIT_TEST_DATABASE_URL`` / ``OUTBOXKIT_TEST_KAFKA_BOOTSTRAP`` when set;
2. testcontainers, when a Docker engine answers;
3. local processes (``outbox.testing.services``), started once per test session.

Each test gets a fresh database cloned from a migrated template, and unique topic names,
so tests pass in any order and when run twice.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.testing.postgres import MAX_PREPARED_TRANSACTIONS

TEMPLATE_DB = "outboxkit_template"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outboxkit")
    group.addoption(
        "--outboxkit-keep-services",
        action="store_true",
        help="leave the local PostgreSQL/Kafka running after the session (faster reruns)",
    )


def _docker_answers() -> bool:
    """True when a Docker engine answers ``/_ping`` on its unix socket (no client library:
    a failed docker-py probe leaks sockets that pytest's warnings would turn into errors)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True  # a remote engine was configured on purpose; let testcontainers try it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(host[len("unix://") :])
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(64)
        except OSError:
            return False


class _Services:
    """Resolves both endpoints lazily, so a Postgres-only run never starts Kafka."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._local: Any = None
        self._started_here: list[str] = []
        self._containers: list[Any] = []
        self._docker: bool | None = None

    def _use_docker(self) -> bool:
        if self._docker is None:
            self._docker = os.environ.get("OUTBOXKIT_TEST_NO_DOCKER") != "1" and _docker_answers()
        return self._docker

    def _local_services(self) -> Any:
        if self._local is None:
            from outbox.testing.services import LocalServices  # noqa: PLC0415

            self._local = LocalServices(
                os.environ.get("OUTBOXKIT_SERVICES_DIR") or self.config.rootpath / ".services"
            )
        return self._local

    def postgres(self) -> str:
        return self._endpoint(
            "postgres", "OUTBOXKIT_TEST_DATABASE_URL", self._postgres_container,
            lambda local: str(local.start_postgres().dsn),
        )

    def kafka(self) -> str:
        return self._endpoint(
            "kafka", "OUTBOXKIT_TEST_KAFKA_BOOTSTRAP", self._kafka_container,
            lambda local: str(local.start_kafka().bootstrap),
        )

    def _endpoint(
        self, name: str, variable: str, container: Callable[[], str],
        start_local: Callable[[Any], str],
    ) -> str:
        """The service's address, in the order the module docstring gives. A local process is
        stopped at the end of the session only if this session started it."""
        if address := os.environ.get(variable):
            return address
        if self._use_docker():
            return container()
        local = self._local_services()
        was_running = local.status()[name] is not None
        address = start_local(local)
        if not was_running:
            self._started_here.append(name)
        return address

    def _postgres_container(self) -> str:
        from testcontainers.postgres import PostgresContainer  # noqa: PLC0415

        # As the local cluster: two-phase commit allowed (emit(..., notify=False) is for it).
        container = (
            PostgresContainer("postgres:16", driver=None)
            .with_command(f"postgres -c max_prepared_transactions={MAX_PREPARED_TRANSACTIONS}")
            .start()
        )
        self._containers.append(container)
        return str(container.get_connection_url())

    def _kafka_container(self) -> str:
        from testcontainers.kafka import KafkaContainer  # noqa: PLC0415

        container = KafkaContainer("apache/kafka:4.1.1").with_kraft().start()
        self._containers.append(container)
        return str(container.get_bootstrap_server())

    def close(self) -> None:
        for container in self._containers:
            with contextlib.suppress(Exception):
                container.stop()
        if self._local is not None and not self.config.getoption("--outboxkit-keep-services"):
            if "kafka" in self._started_here:
                self._local.stop_kafka()
            if "postgres" in self._started_here:
                self._local.stop_postgres()


@pytest.fixture(scope="session")
def outboxkit_services(request: pytest.FixtureRequest) -> Iterator[_Services]:
    services = _Services(request.config)
    try:
        yield services
    finally:
        services.close()


@pytest.fixture(scope="session")
def postgres_dsn(outboxkit_services: _Services) -> str:
    """libpq URL of a PostgreSQL server (its maintenance database) for this test session."""
    return outboxkit_services.postgres()


@pytest.fixture(scope="session")
def kafka_bootstrap(outboxkit_services: _Services) -> str:
    """``host:port`` of a real Kafka broker for this test session."""
    return outboxkit_services.kafka()


def _admin_execute(dsn: str, *statements: str) -> None:
    import psycopg  # noqa: PLC0415

    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # identifiers come from our own uuid-based names


@pytest.fixture(scope="session")
def outboxkit_template(postgres_dsn: str) -> Iterator[str]:
    """A database with the outboxkit schema migrated, cloned for each test."""
    from sqlalchemy import create_engine  # noqa: PLC0415

    # Unique per session: two test sessions against one server must not share a template.
    name = f"{TEMPLATE_DB}_{uuid.uuid4().hex[:10]}"
    _admin_execute(postgres_dsn, f'CREATE DATABASE "{name}"')
    engine = create_engine(sqlalchemy_url(with_database(postgres_dsn, name)))
    try:
        from outbox.db.migrate import migrate  # noqa: PLC0415

        migrate(engine)
    finally:
        engine.dispose()
    _admin_execute(postgres_dsn, f'ALTER DATABASE "{name}" WITH IS_TEMPLATE true')
    yield name
    with contextlib.suppress(Exception):
        _admin_execute(
            postgres_dsn,
            f'ALTER DATABASE "{name}" WITH IS_TEMPLATE false',
            f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
        )


@pytest.fixture
def database_url(
    postgres_dsn: str, outboxkit_template: str, request: pytest.FixtureRequest
) -> Iterator[str]:
    """libpq URL of a fresh database for this test, with the outboxkit schema migrated."""
    slug = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:30]
    name = f"t_{slug}_{uuid.uuid4().hex[:8]}"
    _admin_execute(postgres_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{outboxkit_template}"')
    try:
        yield with_database(postgres_dsn, name)
    finally:
        _admin_execute(postgres_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def engine(database_url: str) -> Iterator[Any]:
    """A SQLAlchemy engine (psycopg 3) on this test's own database."""
    from sqlalchemy import create_engine  # noqa: PLC0415

    eng = create_engine(sqlalchemy_url(database_url), pool_size=10, max_overflow=20)
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def async_engine(database_url: str) -> Iterator[Any]:
    """An asyncio SQLAlchemy engine (psycopg 3) on this test's own database."""
    from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415

    eng = create_async_engine(sqlalchemy_url(database_url), pool_size=10, max_overflow=20)
    yield eng
    eng.sync_engine.dispose()


@pytest.fixture
def kafka_topic(
    kafka_bootstrap: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., str]]:
    """Factory: ``kafka_topic(partitions=1)`` creates a topic unique to this test."""
    from outbox.kafka import Connection, backend  # noqa: PLC0415

    admin = backend(_client_name(), Connection(kafka_bootstrap)).admin("outboxkit-tests")
    created: list[str] = []
    slug = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name)[:40]

    def make(partitions: int = 1, name: str | None = None) -> str:
        topic = name or f"t-{slug}-{uuid.uuid4().hex[:8]}"
        admin.create_topic(topic, partitions)  # replication: the broker's default
        created.append(topic)
        return topic

    try:
        yield make
    finally:
        with contextlib.suppress(Exception):
            if created:
                admin.delete_topics(created)
        admin.close()


def _client_name() -> str:
    """The Kafka client the tests' own helpers use: the one under test (OUTBOXKIT_KAFKA_CLIENT)."""
    return os.environ.get("OUTBOXKIT_KAFKA_CLIENT", "") or "kafka-python"
