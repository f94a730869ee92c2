"""Which services the demo uses: the environment's, else docker compose's when a Docker
engine answers (a stand-in `docker` on PATH records what it was asked), else local ones."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from examples import demo


def fake_docker(tmp_path: Path, *, info: int, compose: int) -> Path:
    log = tmp_path / "docker.log"
    script = tmp_path / "bin" / "docker"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        f'[ "$1" = info ] && exit {info}\n'
        f'[ "$1" = compose ] && {{ echo "compose says no" >&2; exit {compose}; }}\n'
        "exit 0\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return log


def test_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOXKIT_DATABASE_URL", "postgresql://x@db/x")
    monkeypatch.setenv("OUTBOXKIT_KAFKA_BOOTSTRAP", "k:9092")
    assert demo.endpoints() == ("postgresql://x@db/x", "k:9092")


def test_docker_compose_when_an_engine_answers(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    log = fake_docker(tmp_path, info=0, compose=0)
    monkeypatch.delenv("OUTBOXKIT_DATABASE_URL", raising=False)
    monkeypatch.delenv("OUTBOXKIT_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert demo.endpoints() == (demo.COMPOSE_DATABASE_URL, demo.COMPOSE_BOOTSTRAP)
    assert log.read_text().splitlines() == ["info", "compose up -d --wait postgres kafka"]


def test_no_engine_means_local_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_docker(tmp_path, info=1, compose=0)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert demo.docker_answers() is False
