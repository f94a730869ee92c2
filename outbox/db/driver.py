"""psycopg's own cursor on a SQLAlchemy connection, with SQLAlchemy's errors.

A daemon's hottest statements (the relay's claim and record) skip SQLAlchemy's execution:
it builds a result's metadata from the cursor's description on every driver-SQL statement,
which for the claim's 19 columns was a third of its Python. Errors still arrive as
SQLAlchemy's (``DBAPIError`` and its subclasses, ``.orig`` the driver's), and a dropped
connection is invalidated, so callers keep one failure path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError


@contextlib.contextmanager
def driver_cursor(conn: Connection) -> Iterator[psycopg.Cursor[tuple[Any, ...]]]:
    """A cursor of *conn*'s psycopg connection, inside whatever transaction *conn* has."""
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    try:
        with driver.cursor() as cursor:
            yield cursor
    except psycopg.Error as exc:
        raise translated(conn, exc) from exc


def translated(conn: Connection, exc: psycopg.Error, statement: str | None = None,
               parameters: Mapping[str, Any] | None = None) -> DBAPIError:
    """*exc*, raised by psycopg on *conn*'s connection, as SQLAlchemy would have raised it
    (``IntegrityError``, ``OperationalError``, ...); a connection that broke is invalidated,
    so that the pool does not hand it out again."""
    driver = conn.connection.driver_connection
    gone = isinstance(driver, psycopg.Connection) and (driver.closed or driver.broken)
    if gone:
        conn.invalidate(exc)
    error = DBAPIError.instance(statement, parameters, exc, psycopg.Error,
                                connection_invalidated=gone, dialect=conn.dialect)
    assert isinstance(error, DBAPIError)  # psycopg's errors are all DB-API errors
    return error
