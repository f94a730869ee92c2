"""A daemon's pooled connection is tested before use only after it sat idle
(outbox.db.engines.engine_for(ping_after_idle_s=...)): one that died meanwhile is replaced
without the caller seeing a failure, and a busy connection costs no extra round trip."""

from __future__ import annotations

import time

import pytest
import sqlalchemy
from sqlalchemy import Engine, text

from outbox.db.engines import engine_for


def _pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _kill(admin: Engine, pid: int) -> None:
    with admin.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()


def test_a_connection_that_died_while_idle_is_replaced_on_checkout(
    database_url: str, engine: Engine
) -> None:
    daemon = engine_for(database_url, pool_size=1, max_overflow=0, ping_after_idle_s=0.2)
    try:
        first = _pid(daemon)
        _kill(engine, first)
        time.sleep(0.3)
        assert _pid(daemon) != first  # no error: the ping found it gone, a new one served
    finally:
        daemon.dispose()


def test_a_connection_used_again_at_once_is_not_pinged(database_url: str, engine: Engine) -> None:
    # The same death, caught by no ping: the statement fails (what the relay's loop then
    # handles as any lost connection). This is the round trip the busy path saves.
    daemon = engine_for(database_url, pool_size=1, max_overflow=0, ping_after_idle_s=60)
    try:
        first = _pid(daemon)
        _kill(engine, first)
        time.sleep(0.1)
        with pytest.raises(sqlalchemy.exc.OperationalError):
            _pid(daemon)
        assert _pid(daemon) != first  # and the pool replaced it for the next use
    finally:
        daemon.dispose()


def test_the_ping_leaves_no_transaction_open(database_url: str) -> None:
    daemon = engine_for(database_url, pool_size=1, max_overflow=0, ping_after_idle_s=0)
    try:
        with daemon.connect() as conn:
            conn.execute(text("SELECT 1"))
            conn.commit()
        with daemon.connect() as conn:  # pinged on this checkout
            raw = conn.connection.dbapi_connection
            assert raw is not None
            assert raw.info.transaction_status.name == "IDLE"
            assert raw.autocommit is False
    finally:
        daemon.dispose()
