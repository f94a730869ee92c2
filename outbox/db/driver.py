"""psycopg's own cursor on a SQLAlchemy connection, with SQLAlchemy's errors.

A daemon's hottest statements (the relay's claim and record) skip SQLAlchemy's execution:
it builds a result's metadata from the cursor's description on every driver-SQL statement,
which for the claim's 19 columns was a third of its Python. Errors still arrive as
SQLAlchemy's (``DBAPIError`` and its subclasses, ``.orig`` the driver's), and a dropped
connection is invalidated, so callers keep one failure path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError


@contextlib.contextmanager
def driver_cursor(conn: Connection) -> Iterator[psycopg.Cursor[tuple[Any, ...]]]:
    """A cursor of *conn*'s psycopg connection, inside whatever transaction *conn* has."""
    fairy = conn.connection
    driver = fairy.driver_connection
    assert isinstance(driver, psycopg.Connection)
    try:
        with driver.cursor() as cursor:
            yield cursor
    except psycopg.Error as exc:
        gone = conn.dialect.is_disconnect(exc, fairy.dbapi_connection, None)  # type: ignore[arg-type]
        if gone:
            conn.invalidate(exc)
        raise DBAPIError.instance(
            None, None, exc, psycopg.Error, connection_invalidated=gone, dialect=conn.dialect
        ) from exc
