"""psycopg's errors, raised under a SQLAlchemy connection, as SQLAlchemy would raise them.

The consumer's dedup marks (dedup/inbox.py) run on the psycopg connection under a SQLAlchemy
one (a pipeline, a commit that overlaps the next BEGIN): what they raise must still be
SQLAlchemy's (``DBAPIError`` and its subclasses, ``.orig`` the driver's), and a dropped
connection invalidated, so callers keep one failure path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError


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
