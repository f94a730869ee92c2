"""The relay's pool without SQLAlchemy (outbox/db/pool.py) does what SQLAlchemy's pool did for
it: one connection serves use after use, a broken one is replaced, one that sat idle is
tested first, and a failed use hands no unknown state to the next."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from outbox.db.pool import Pool, scalar


@pytest.fixture
def pool(database_url: str) -> Iterator[Pool]:
    made = Pool(database_url, size=1, ping_after_idle_s=0.2)
    yield made
    made.close()


def backend(pool: Pool) -> int:
    with pool.connection() as conn:
        pid = scalar(conn, "SELECT pg_backend_pid()")
    assert isinstance(pid, int)
    return pid


def terminate(database_url: str, pid: int) -> None:
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    time.sleep(0.1)


def test_one_connection_serves_every_use_in_autocommit(pool: Pool) -> None:
    first = backend(pool)
    assert backend(pool) == first
    with pool.connection() as conn:
        assert conn.autocommit
        row = conn.execute("SELECT 1 AS one").fetchone()
        assert row is not None
        assert row.one == 1  # named rows


def test_connections_beyond_its_size_are_closed_when_given_back(pool: Pool) -> None:
    with pool.connection() as a, pool.connection() as b:  # two threads' worth
        pass
    assert sorted([a.closed, b.closed]) == [False, True]  # one kept idle, the other closed
    pool.close()
    assert a.closed
    assert b.closed


def test_a_connection_that_broke_under_a_use_is_replaced_for_the_next(
    pool: Pool, database_url: str
) -> None:
    first = backend(pool)

    def use_while_it_dies() -> None:
        with pool.connection() as conn:
            terminate(database_url, first)
            conn.execute("SELECT 1")

    with pytest.raises(psycopg.OperationalError):
        use_while_it_dies()
    assert backend(pool) != first


def test_one_idle_past_its_bound_is_tested_and_replaced_without_an_error(
    pool: Pool, database_url: str
) -> None:
    first = backend(pool)
    terminate(database_url, first)  # a server restart, a proxy's idle timeout
    time.sleep(0.2)
    assert backend(pool) != first  # no error reached the caller


def test_a_failed_transaction_is_rolled_back_and_the_connection_kept(pool: Pool) -> None:
    first = backend(pool)

    def fail() -> None:
        with pool.begin() as conn:
            conn.execute("CREATE TEMP TABLE t (x int)")
            raise RuntimeError("the caller's own bug")

    with pytest.raises(RuntimeError):
        fail()
    with pool.connection() as conn:
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert scalar(conn, "SELECT to_regclass('pg_temp.t') IS NULL")  # rolled back
    assert backend(pool) == first


def test_a_transaction_commits_at_the_end_of_its_block(pool: Pool, database_url: str) -> None:
    with pool.begin() as conn:
        conn.execute("CREATE TABLE committed_here (x int)")
        conn.execute("INSERT INTO committed_here VALUES (1)")
    with psycopg.connect(database_url) as other:
        assert other.execute("SELECT x FROM committed_here").fetchone() == (1,)


def test_a_use_left_inside_a_transaction_closes_the_connection(pool: Pool) -> None:
    # Given back inside a transaction (begun outside begin()'s block), it would hand its
    # locks and its snapshot to the next use: it is closed instead.
    with pool.connection() as conn:
        conn.execute("BEGIN")
        left = conn
    assert left.closed
    with pool.connection() as conn:
        assert conn is not left


def test_threads_get_a_connection_each(pool: Pool) -> None:
    seen: set[int] = set()
    inside = threading.Barrier(2)

    def use() -> None:
        with pool.connection() as conn:
            inside.wait(5)  # both hold one at once
            seen.add(scalar(conn, "SELECT pg_backend_pid()"))

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 2
