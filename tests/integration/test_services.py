"""The local-services command as a user runs it: idempotent up, clean down, clear errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from outbox.testing.processes import pid_alive


def services(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.testing.services", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def exports(stdout: str) -> dict[str, str]:
    pairs = (line.removeprefix("export ").split("=", 1) for line in stdout.splitlines())
    return dict(pairs)  # type: ignore[arg-type]


def test_up_twice_reuses_and_down_leaves_no_process(tmp_path: Path) -> None:
    state = str(tmp_path / "svc")
    first = services("--dir", state, "up")
    assert first.returncode == 0, first.stderr
    try:
        second = services("--dir", state, "up")
        assert second.returncode == 0, second.stderr
        assert exports(first.stdout) == exports(second.stdout)
        assert "OUTBOXKIT_TEST_DATABASE_URL" in exports(first.stdout)
        status = services("--dir", state, "status")
        assert status.returncode == 0
        pids = [int(w.strip(",")) for w in status.stdout.split() if w.strip(",").isdigit()]
        assert len(pids) == 2
        assert all(pid_alive(p) for p in pids)
    finally:
        down = services("--dir", state, "down")
    assert down.returncode == 0, down.stderr
    assert "kafka" in down.stderr
    assert "postgres" in down.stderr
    assert not any(pid_alive(p) for p in pids)
    assert services("--dir", state, "status").returncode == 3
    # down again is harmless too
    assert services("--dir", state, "down").returncode == 0


def test_port_already_taken_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        started = time.monotonic()
        result = services("--dir", str(tmp_path / "svc"), "up", "--pg-port", str(port), timeout=60)
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "--pg-port" in result.stderr
    assert time.monotonic() - started < 30


def _bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        "PATH": str(tmp_path / "empty-bin"),
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        **extra,
    }
    (tmp_path / "empty-bin").mkdir(exist_ok=True)
    return env


def _bin_with(tmp_path: Path, *tools: str) -> str:
    folder = tmp_path / "some-bin"
    folder.mkdir(exist_ok=True)
    for tool in tools:
        real = subprocess.run(["which", tool], capture_output=True, text=True, check=True)
        (folder / tool).symlink_to(real.stdout.strip())
    return str(folder)


def test_missing_postgres_binaries_say_how_to_install(tmp_path: Path) -> None:
    env = _bare_env(tmp_path, OUTBOXKIT_PG_BIN=str(tmp_path / "no-such-dir"))
    result = services("--dir", str(tmp_path / "svc"), "start", "postgres", env=env)
    assert result.returncode == 1
    assert "initdb" in result.stderr
    assert "apt-get install postgresql" in result.stderr


def test_no_java_on_an_empty_path_says_how_to_install(tmp_path: Path) -> None:
    result = services("--dir", str(tmp_path / "svc"), "start", "kafka", env=_bare_env(tmp_path))
    assert result.returncode == 1
    assert "java was not found" in result.stderr
    assert "openjdk-17" in result.stderr


def test_fake_java_home_is_named(tmp_path: Path) -> None:
    fake = tmp_path / "fake-jdk"
    fake.mkdir()
    result = services(
        "--dir",
        str(tmp_path / "svc"),
        "start",
        "kafka",
        env=_bare_env(tmp_path, JAVA_HOME=str(fake)),
    )
    assert result.returncode == 1
    assert f"JAVA_HOME={fake}" in result.stderr
    assert "Java 17+" in result.stderr


def test_too_old_java_is_refused(tmp_path: Path) -> None:
    jdk = tmp_path / "old-jdk"
    (jdk / "bin").mkdir(parents=True)
    java = jdk / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'openjdk version \"11.0.22\" 2024-01-16' >&2\n")
    java.chmod(0o755)
    result = services(
        "--dir",
        str(tmp_path / "svc"),
        "start",
        "kafka",
        env=_bare_env(tmp_path, JAVA_HOME=str(jdk)),
    )
    assert result.returncode == 1
    assert "Java 17 or newer (found Java 11" in result.stderr


def test_no_maven_says_how_to_install(tmp_path: Path) -> None:
    env = _bare_env(tmp_path, PATH=_bin_with(tmp_path, "java"))
    result = services("--dir", str(tmp_path / "svc"), "start", "kafka", env=env)
    assert result.returncode == 1
    assert "mvn (Apache Maven) was not found" in result.stderr
    assert "apt-get install maven" in result.stderr


@pytest.mark.timeout(240)
def test_no_network_to_maven_central_is_a_clear_error(tmp_path: Path) -> None:
    settings = tmp_path / "settings.xml"
    # Every repository is mirrored to a closed loopback port: what no network looks like.
    settings.write_text(
        "<settings><mirrors><mirror><id>nowhere</id><mirrorOf>*</mirrorOf>"
        "<url>http://127.0.0.1:9/maven2</url></mirror></mirrors></settings>"
    )
    env = _bare_env(
        tmp_path,
        PATH=_bin_with(tmp_path, "java", "mvn"),
        OUTBOXKIT_MAVEN_SETTINGS=str(settings),
        OUTBOXKIT_MAVEN_REPO_LOCAL=str(tmp_path / "m2"),
        JAVA_HOME=os.environ.get("JAVA_HOME", "/usr/lib/jvm/java-17-openjdk-amd64"),
    )
    result = services("--dir", str(tmp_path / "svc"), "start", "kafka", env=env, timeout=220)
    assert result.returncode == 1
    assert "Maven could not download the Kafka broker's jars from Maven Central" in result.stderr
    assert not list((tmp_path / "cache").glob("outboxkit/kafka-jars-*/*.jar"))


# What tests/integration/test_postgres_roundtrip.py checked that is outboxkit's (the rest was
# PostgreSQL itself): the plugin's database_url is a database of the test's own, already
# migrated. The same primary key in both runs only fits if each run has its own database.
@pytest.mark.parametrize("run", [1, 2])
def test_each_test_gets_a_migrated_database_of_its_own(database_url: str, run: int) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute("CREATE TABLE outboxkit.isolation_probe (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO outboxkit.isolation_probe VALUES (1, current_database())")
        assert conn.execute("SELECT count(*) FROM outboxkit.schema_versions").fetchone() != (0,)
