"""A connection kept checked out between uses (outbox/db/kept.py) does what the pool did for
the relay's claims and records: a broken one is replaced, one that sat idle is tested first,
and a failed use hands no unknown state to the next."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from outbox.db.dsn import engine_for
from outbox.db.kept import KeptConnection


@pytest.fixture
def autocommit(database_url: str) -> Any:
    eng = engine_for(database_url, pool_size=1, max_overflow=0, isolation_level="AUTOCOMMIT",
                     ping_after_idle_s=0.2, pool_reset_on_return=None)
    yield eng
    eng.dispose()


def backend(kept: KeptConnection) -> int:
    with kept.use() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    assert isinstance(pid, int)
    return pid


def terminate(engine: Engine, pid: int) -> None:
    with engine.connect() as admin:
        admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    time.sleep(0.1)


def test_one_connection_serves_every_use_and_stays_checked_out(autocommit: Engine) -> None:
    kept = KeptConnection(autocommit, idle_s=60)
    first = backend(kept)
    assert backend(kept) == first
    assert autocommit.pool.checkedout() == 1  # type: ignore[attr-defined]
    kept.close()
    assert autocommit.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_connection_that_broke_under_a_use_is_replaced_for_the_next(
    autocommit: Engine, engine: Engine
) -> None:
    kept = KeptConnection(autocommit, idle_s=60)
    first = backend(kept)
    terminate(engine, first)
    with pytest.raises(OperationalError), kept.use() as conn:
        conn.execute(text("SELECT 1"))
    assert backend(kept) != first
    kept.close()


def test_one_idle_past_its_bound_is_tested_and_replaced_without_an_error(
    autocommit: Engine, engine: Engine
) -> None:
    kept = KeptConnection(autocommit, idle_s=0.2)
    first = backend(kept)
    terminate(engine, first)  # a server restart, a proxy's idle timeout
    time.sleep(0.2)
    assert backend(kept) != first  # no error reached the caller
    kept.close()


def test_a_use_that_failed_leaves_no_transaction_behind(autocommit: Engine) -> None:
    kept = KeptConnection(autocommit, idle_s=60)

    def fail() -> None:
        with kept.use() as conn:
            conn.execute(text("SELECT 1"))
            raise RuntimeError("the caller's own bug")

    with pytest.raises(RuntimeError):
        fail()
    with kept.use() as conn:
        assert not conn.in_transaction()
        assert conn.execute(text("SELECT 2")).scalar_one() == 2
    kept.close()
