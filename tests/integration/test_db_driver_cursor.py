"""psycopg's cursor on a SQLAlchemy connection (outbox.db.driver.driver_cursor) fails the way
SQLAlchemy's execution does: the relay's claim and record rely on one failure path."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from outbox.db.driver import driver_cursor
from outbox.db.dsn import engine_for


def test_rows_come_as_tuples_inside_the_connections_transaction(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TEMP TABLE t (x int) ON COMMIT DROP"))
        with driver_cursor(conn) as cursor:
            cursor.execute("INSERT INTO t VALUES (%(a)s), (%(b)s)", {"a": 1, "b": 2})
        with driver_cursor(conn) as cursor:
            cursor.execute("SELECT x FROM t ORDER BY x")
            assert cursor.fetchall() == [(1,), (2,)]


def test_a_database_error_is_sqlalchemys_with_the_drivers_inside(engine: Engine) -> None:
    with (engine.connect() as conn, pytest.raises(ProgrammingError) as raised,
          driver_cursor(conn) as cursor):
        cursor.execute("SELECT * FROM no_such_table_here")
    assert raised.value.orig is not None
    assert getattr(raised.value.orig, "sqlstate", None) == "42P01"
    assert not raised.value.connection_invalidated


def test_a_dropped_connection_is_invalidated_and_replaced(
    database_url: str, engine: Engine
) -> None:
    daemon = engine_for(database_url, pool_size=1, max_overflow=0)
    try:
        with daemon.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with engine.connect() as admin:
                admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            with pytest.raises(OperationalError) as raised, driver_cursor(conn) as cursor:
                cursor.execute("SELECT 1")
            assert raised.value.connection_invalidated
        with daemon.connect() as conn:  # the pool's next connection is a new one
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
    finally:
        daemon.dispose()
