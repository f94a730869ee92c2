"""aio.emit inside a transaction SQLAlchemy began goes straight to psycopg
(outbox.db.execution.driver_row_async): the caller's transaction still owns it, and errors are
SQLAlchemy's (real PostgreSQL)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Engine, event, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio
from outbox.db.tables import outbox_messages
from outbox.errors import SchemaError
from outbox.messages.envelope import Envelope
from outbox.settings import OutboxSettings


def _envelope(payload: str) -> Envelope:
    return Envelope(topic="orders", type="order.placed", key="k", payload=payload)


def _payloads(engine: Engine) -> list[bytes]:
    with engine.connect() as conn:
        return list(conn.execute(select(outbox_messages.c.payload)
                                 .order_by(outbox_messages.c.id)).scalars())


def test_a_direct_emit_commits_and_rolls_back_with_the_callers_transaction(
        engine: Engine, async_engine: AsyncEngine) -> None:
    sent: list[str] = []

    def record(*args: Any) -> None:
        sent.append(args[2])

    async def scenario() -> None:
        event.listen(async_engine.sync_engine, "before_cursor_execute", record)
        async with async_engine.connect() as conn:
            await conn.execute(text("SELECT 1"))  # SQLAlchemy begins the transaction
            await aio.emit(conn, _envelope("rolled back"))
            await conn.rollback()
            await conn.execute(text("SELECT 1"))
            await aio.emit(conn, _envelope("kept"))
            await conn.commit()
        await async_engine.dispose()

    asyncio.run(scenario())
    assert _payloads(engine) == [b'"kept"']
    assert sent == ["SELECT 1", "SELECT 1"]  # both emits went to psycopg directly


def test_a_direct_emit_raises_what_the_sqlalchemy_path_raises(
        engine: Engine, async_engine: AsyncEngine) -> None:
    nowhere = OutboxSettings(schema_name="no_such_schema")

    async def scenario() -> None:
        async with async_engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
            # psycopg's UndefinedTable becomes SQLAlchemy's ProgrammingError, which emit
            # explains (run `outbox migrate`), as on the SQLAlchemy path.
            with pytest.raises(SchemaError, match="outbox migrate"):
                await aio.emit(conn, _envelope("lost"), settings=nowhere)
            await conn.rollback()
            await aio.emit(conn, _envelope("after"))
            await conn.commit()
        await async_engine.dispose()

    asyncio.run(scenario())
    assert _payloads(engine) == [b'"after"']
