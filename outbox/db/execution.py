"""Running SQL *plans* on the caller's connection, sync or async, without duplicating logic.

A plan is a generator that yields SQLAlchemy Core statements and receives each one's rows
back; its return value is the function's result. The same plan runs on a ``Connection`` /
``Session`` (:func:`run_plan`) or an ``AsyncConnection`` / ``AsyncSession``
(:func:`run_plan_async`), so the sync API and its async twin share every decision. A plan
may also yield a :class:`DriverStatement` (a named query, :func:`outbox.db.queries.driver_sql`,
and its parameters), sent straight to psycopg: the statements of a worker's hot path.
Executors never begin, commit or roll back: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, Executable, RowMapping
from sqlalchemy.exc import DBAPIError, NoResultFound, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox.db.schema import translate
from outbox.errors import SchemaError
from outbox.settings import OutboxSettings, default_settings

T = TypeVar("T")
Rows = Sequence[RowMapping]


@dataclass(frozen=True)
class DriverStatement:
    """Driver SQL (``%(name)s`` placeholders) and its parameters, for a plan to yield: it is
    sent as is (``exec_driver_sql``; async: :func:`driver_row_async`) and must return exactly
    one row, which the plan gets back as ``rows[0]`` (read it by column name)."""

    sql: str
    params: Mapping[str, Any]


Plan = Generator[Executable | DriverStatement, Rows, T]
SyncConn = Connection | Session
AsyncConn = AsyncConnection | AsyncSession


def options(settings: OutboxSettings | None) -> dict[str, Any]:
    """Execution options that point the placeholder schema at the configured one."""
    return {"schema_translate_map": translate(settings or default_settings())}


def missing_schema(exc: ProgrammingError, settings: OutboxSettings | None) -> SchemaError | None:
    """The SchemaError that explains *exc* when it is an undefined table or schema."""
    if getattr(exc.orig, "sqlstate", None) not in {"42P01", "3F000"}:  # undefined table/schema
        return None
    schema = (settings or default_settings()).schema_name
    return SchemaError(
        f"outboxkit tables are missing from schema {schema!r}: run `outbox migrate` "
        "(outbox.db.migrate.migrate(engine)) against this database first"
    )


def _rows(result: Any) -> Rows:
    return list(result.mappings().all()) if result.returns_rows else []


def run_plan(conn: SyncConn, plan: Plan[T], settings: OutboxSettings | None = None) -> T:
    """Drive *plan* on a sync connection or session (never commits)."""
    opts = options(settings)
    try:
        statement = next(plan)
        while True:
            try:
                if isinstance(statement, DriverStatement):
                    connection = conn.connection() if isinstance(conn, Session) else conn
                    rows: Rows = [driver_row(connection, statement.sql,
                                             statement.params)._asdict()]
                else:
                    rows = _rows(conn.execute(statement, execution_options=opts))
            except ProgrammingError as exc:
                if (translated := missing_schema(exc, settings)) is None:
                    raise
                raise translated from exc
            statement = plan.send(rows)
    except StopIteration as stop:
        value: T = stop.value
        return value


async def run_plan_async(conn: AsyncConn, plan: Plan[T],
                         settings: OutboxSettings | None = None) -> T:
    """Drive *plan* on an async connection or session (never commits)."""
    opts = options(settings)
    try:
        statement = next(plan)
        while True:
            try:
                if isinstance(statement, DriverStatement):
                    connection = (await conn.connection() if isinstance(conn, AsyncSession)
                                  else conn)
                    row = await driver_row_async(connection, statement.sql, statement.params)
                    rows: Rows = [row._asdict()]
                else:
                    rows = _rows(await conn.execute(statement, execution_options=opts))
            except ProgrammingError as exc:
                if (translated := missing_schema(exc, settings)) is None:
                    raise
                raise translated from exc
            statement = plan.send(rows)
    except StopIteration as stop:
        value: T = stop.value
        return value


def driver_row(conn: Connection, sql: str, params: Mapping[str, Any]) -> Any:
    """The one row of driver SQL *sql* (attributes by column name), on *conn*; never commits.

    :func:`driver_row_async`'s sync twin, for the same reason: inside a transaction SQLAlchemy
    began, the statement goes straight to psycopg's cursor (SQLAlchemy's result describes
    each column anew: about as much client CPU as psycopg's own work). Errors are
    SQLAlchemy's, as through SQLAlchemy; a lost connection invalidates *conn*, as SQLAlchemy
    does. The first statement of a transaction goes through SQLAlchemy, which begins it.
    """
    if conn.invalidated or not conn.in_transaction():
        return conn.exec_driver_sql(sql, dict(params)).one()
    dbapi = conn.connection.dbapi_connection
    driver = conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):  # an async engine's, driven through run_sync
        return conn.exec_driver_sql(sql, dict(params)).one()
    try:
        with driver.cursor(row_factory=namedtuple_row) as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
    except psycopg.Error as exc:
        gone = conn.dialect.is_disconnect(exc, dbapi, None)  # type: ignore[arg-type]
        if gone:
            conn.invalidate(exc)
        raise DBAPIError.instance(sql, params, exc, psycopg.Error, dialect=conn.dialect,
                                  connection_invalidated=gone) from exc
    if row is None:
        raise NoResultFound("the statement returned no row; it must return one")
    return row


async def driver_row_async(conn: AsyncConnection, sql: str, params: Mapping[str, Any]) -> Any:
    """The one row of driver SQL *sql* (attributes by column name), on *conn*; never commits.

    Inside a transaction SQLAlchemy already began on *conn*, the statement goes straight to
    psycopg's connection. SQLAlchemy's asyncio layer costs every statement a greenlet switch
    and a buffered result: about as much CPU as psycopg's own work for the statement, which
    made an async agent step with an emit lose a third of its throughput on two busy cores
    against one without (the sync path loses a fifth). Errors are SQLAlchemy's, as through
    SQLAlchemy. The first statement of a transaction goes through SQLAlchemy, which begins it
    (and so commits or rolls it back when the caller does); so does one on a connection
    SQLAlchemy invalidated. Statement events (``before_cursor_execute``) do not see the
    direct ones.
    """
    sync = conn.sync_connection
    if sync is None or sync.invalidated or not sync.in_transaction():
        return (await conn.exec_driver_sql(sql, dict(params))).one()
    driver = sync.connection.driver_connection
    try:
        async with driver.cursor(row_factory=namedtuple_row) as cursor:  # type: ignore[union-attr]
            await cursor.execute(sql, params)
            row = await cursor.fetchone()
    except psycopg.Error as exc:
        raise DBAPIError.instance(sql, params, exc, psycopg.Error,
                                  dialect=sync.dialect) from exc
    if row is None:
        raise NoResultFound("the statement returned no row; it must return one")
    return row
