"""Running SQL *plans* on the caller's connection, sync or async, without duplicating logic.

A plan is a generator that yields SQLAlchemy Core statements and receives each one's rows
back; its return value is the function's result. The same plan runs on a ``Connection`` /
``Session`` (:func:`run_plan`) or an ``AsyncConnection`` / ``AsyncSession``
(:func:`run_plan_async`), so the sync API and its async twin share every decision.
Executors never begin, commit or roll back: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Executable, RowMapping
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox.errors import SchemaError
from outbox.schema import translate
from outbox.settings import OutboxSettings, default_settings

T = TypeVar("T")
Rows = Sequence[RowMapping]
Plan = Generator[Executable, Rows, T]
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
        "(outbox.migrate.migrate(engine)) against this database first"
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
                result = conn.execute(statement, execution_options=opts)
            except ProgrammingError as exc:
                if (translated := missing_schema(exc, settings)) is None:
                    raise
                raise translated from exc
            statement = plan.send(_rows(result))
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
                result = await conn.execute(statement, execution_options=opts)
            except ProgrammingError as exc:
                if (translated := missing_schema(exc, settings)) is None:
                    raise
                raise translated from exc
            statement = plan.send(_rows(result))
    except StopIteration as stop:
        value: T = stop.value
        return value
