"""psycopg's errors under a SQLAlchemy connection (outbox.db.driver.translated) are raised as
SQLAlchemy's execution raises them: the consumer's dedup marks rely on one failure path."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

from outbox.db.driver import translated
from outbox.db.engines import engine_for


def driver_error(conn: Connection, statement: str) -> DBAPIError:
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    with pytest.raises(psycopg.Error) as raised:
        driver.execute(statement)
    return translated(conn, raised.value, statement, {})


def test_a_database_error_is_sqlalchemys_with_the_drivers_inside(engine: Engine) -> None:
    with engine.connect() as conn:
        error = driver_error(conn, "SELECT * FROM no_such_table_here")
    assert isinstance(error, ProgrammingError)
    assert getattr(error.orig, "sqlstate", None) == "42P01"
    assert not error.connection_invalidated


def test_a_dropped_connection_is_invalidated_and_replaced(
    database_url: str, engine: Engine
) -> None:
    daemon = engine_for(database_url, pool_size=1, max_overflow=0)
    try:
        with daemon.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with engine.connect() as admin:
                admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            error = driver_error(conn, "SELECT 1")
            assert isinstance(error, OperationalError)
            assert error.connection_invalidated
        with daemon.connect() as conn:  # the pool's next connection is a new one
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
    finally:
        daemon.dispose()
