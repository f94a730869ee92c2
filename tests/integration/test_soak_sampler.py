"""The leak soak's sampler (tests/faults/leaks.py) on a real child process: it sees the files,
threads and PostgreSQL connections the child opens, and the rule fails the child that keeps
opening them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Engine, create_engine

from outbox.db.dsn import sqlalchemy_url
from tests.faults import leaks

# Holds what it is told to open until it exits: "files N", "threads N", "pg N", "close-pg N".
CHILD = textwrap.dedent("""
    import sys, threading, psycopg
    held, conns, stop = [], [], threading.Event()
    for line in sys.stdin:
        what, n = line.split()
        for _ in range(int(n)):
            if what == "files":
                held.append(open(sys.executable, "rb"))
            elif what == "threads":
                threading.Thread(target=stop.wait, daemon=True).start()
            elif what == "pg":
                conns.append(psycopg.connect(sys.argv[1]))
            elif what == "close-pg":
                conns.pop().close()
        print("ok", flush=True)
""")


class Child:
    def __init__(self, dsn: str) -> None:
        self.popen = subprocess.Popen([sys.executable, "-c", CHILD, dsn], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def do(self, what: str, n: int) -> None:
        assert self.popen.stdin is not None
        assert self.popen.stdout is not None
        self.popen.stdin.write(f"{what} {n}\n")
        self.popen.stdin.flush()
        assert self.popen.stdout.readline().strip() == "ok"

    def stop(self) -> None:
        """Its standard input closed: it exits."""
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        self.popen.wait(timeout=10)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def child(postgres_dsn: str) -> Iterator[Child]:
    c = Child(postgres_dsn)
    c.do("files", 0)  # started, psycopg imported
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def admin(postgres_dsn: str) -> Iterator[Engine]:
    eng = create_engine(sqlalchemy_url(postgres_dsn), pool_size=1)
    yield eng
    eng.dispose()


def sample(child: Child, admin: Engine, postgres_dsn: str) -> dict[str, float]:
    with admin.connect() as conn:
        got = leaks.sample({"child": child.pid}, conn, urlsplit(postgres_dsn).port or 5432)
    return got["child"]


def test_the_sampler_sees_files_threads_and_connections(child: Child, admin: Engine,
                                                        postgres_dsn: str) -> None:
    before = sample(child, admin, postgres_dsn)
    assert before["pg_connections"] == 0  # the test's own connection is not the child's
    assert before["rss_mib"] > 5
    child.do("files", 5)
    child.do("threads", 3)
    child.do("pg", 3)
    after = sample(child, admin, postgres_dsn)
    assert after["threads"] - before["threads"] == 3
    assert after["pg_connections"] == 3
    assert after["fds"] - before["fds"] == 5 + 3  # the files, and a socket per connection
    child.do("close-pg", 2)
    assert sample(child, admin, postgres_dsn)["pg_connections"] == 1


def test_a_leaking_child_fails_the_rule_and_a_steady_one_passes(child: Child, admin: Engine,
                                                                 postgres_dsn: str) -> None:
    steady = [sample(child, admin, postgres_dsn) for _ in range(8)]
    leaking = []
    for _ in range(8):
        child.do("files", 2)
        child.do("threads", 1)
        leaking.append(sample(child, admin, postgres_dsn))
    for metric in ("fds", "threads"):
        assert leaks.judge("child", metric, [s[metric] for s in steady]).ok
        verdict = leaks.judge("child", metric, [s[metric] for s in leaking])
        assert not verdict.ok, verdict


def test_a_process_that_exited_is_left_out_of_the_sample(child: Child, admin: Engine,
                                                          postgres_dsn: str) -> None:
    child.stop()
    with admin.connect() as conn:
        assert leaks.sample({"child": child.pid}, conn, 1) == {}
