"""Property: every envelope is either written exactly as given, or refused with nothing written.

Against the real PostgreSQL. All examples share one connection and one outer transaction
(fast); each example runs in its own SAVEPOINT, rolled back at its end. When a case is
refused, the outbox table is counted *inside that savepoint, after the error*: the count
proves nothing was written, and that the statement runs at all proves the transaction is
still usable (``emit`` validates before it sends any statement, so an ``InvalidMessage``
never aborts the caller's transaction; it need not roll back).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from outbox import aio
from outbox.db.dsn import sqlalchemy_url
from outbox.db.tables import outbox_messages
from outbox.errors import InvalidMessage
from outbox.messages.emit import emit, emit_many
from outbox.messages.envelope import Envelope
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import claim, start_run
from tests.faults.properties.envelope_cases import FAULTS, SETTINGS, Case, batches, emits
from tests.faults.properties.profiles import share

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def conn(module_engine: Engine) -> Iterator[Connection]:
    with module_engine.connect() as connection:
        outer = connection.begin()
        try:
            yield connection
        finally:
            outer.rollback()


@pytest.fixture(scope="module")
def lease(conn: Connection) -> Lease:
    """A live lease on a running run (fenced emits), in the outer transaction."""
    start_run(conn, workflow="props", workflow_version="1", idempotency_key="props-run")
    claimed = claim(conn, worker="props-worker", lease_seconds=3600)
    assert claimed is not None
    return claimed.lease


def count(conn: Connection) -> int:
    return int(conn.execute(select(func.count()).select_from(outbox_messages)).scalar_one())


def same(given_value: Any, stored: Any) -> bool:
    """JSON equality that also compares types (True is not 1, 1 is not 1.0)."""
    if type(given_value) is not type(stored):
        return False
    if isinstance(given_value, list):
        return len(given_value) == len(stored) and all(map(same, given_value, stored))
    if isinstance(given_value, dict):
        return given_value.keys() == stored.keys() and all(
            same(v, stored[k]) for k, v in given_value.items()
        )
    if isinstance(given_value, float):
        return given_value == stored and math.copysign(1, given_value) == math.copysign(1, stored)
    return bool(given_value == stored)


def expect_refused(case: Case) -> None:
    """Building the envelope fails with InvalidMessage naming the field of the wrong type
    (``headers[...]`` for one header), pydantic's ValidationError as its cause."""
    field = case.expect.removeprefix("validation:") if case.expect else ""
    with pytest.raises(InvalidMessage) as caught:
        Envelope(**case.fields)
    assert caught.value.field == field or caught.value.field.startswith(f"{field}[")
    assert field in str(caught.value)
    assert isinstance(caught.value.__cause__, ValidationError)


def check_row(conn: Connection, envelope: Envelope, lease: Lease | None) -> None:
    """The stored row is what was given: payload, key, type, topic, headers, run."""
    row = conn.execute(
        select(outbox_messages).where(outbox_messages.c.message_id == envelope.message_id)
    ).one()
    assert same(envelope.payload, json.loads(row.payload))
    key = envelope.key.encode() if isinstance(envelope.key, str) else envelope.key
    assert row.key == key
    assert (row.topic, row.message_type) == (envelope.topic, envelope.type)
    run_id = lease.run_id if lease is not None else envelope.run_id
    assert row.run_id == run_id
    headers = row.headers
    assert headers["message-id"] == str(envelope.message_id)
    assert headers["message-type"] == envelope.type
    assert headers.get("run-id") == (str(run_id) if run_id else None)
    for name, value in envelope.headers.items():
        assert headers[name] == value
    for name, value in {
        "correlation-id": envelope.correlation_id,
        "causation-id": envelope.causation_id,
        "workflow-version": envelope.workflow_version,
        "schema-version": envelope.schema_version,
    }.items():
        assert headers.get(name) == value


KINDS = ["valid", *FAULTS]
EACH = share(len(KINDS) + 1)  # + the emit_many test: together at least EXAMPLES cases


@pytest.mark.parametrize("kind", KINDS)
@EACH
@given(data=st.data())
def test_emit_writes_exactly_what_was_given_or_nothing(
    conn: Connection, lease: Lease, kind: str, data: st.DataObject
) -> None:
    """``emit`` of a valid envelope, or of one with a fault of *kind*."""
    call = data.draw(emits(None if kind == "valid" else kind))
    check_call(conn, lease, call)


@EACH
@given(call=batches())
def test_emit_many_writes_all_or_nothing(
    conn: Connection, lease: Lease, call: tuple[bool, list[Case]]
) -> None:
    """``emit_many`` of 2-5 envelopes, some with faults: all written, or none."""
    check_call(conn, lease, call)


def check_call(conn: Connection, lease: Lease, call: tuple[bool, list[Case]]) -> None:
    with_lease, items = call
    used = lease if with_lease else None
    savepoint = conn.begin_nested()
    try:
        before = count(conn)
        if items[0].expect is not None and items[0].expect.startswith("validation:"):
            expect_refused(items[0])
            assert count(conn) == before
            return
        envelopes = [Envelope(**case.fields) for case in items]
        faults = [case.expect for case in items if case.expect is not None]
        if faults:
            with pytest.raises(InvalidMessage) as caught:
                write(conn, envelopes, used)
            # emit_many validates in order before any statement: the first fault is named,
            # with its place in the batch.
            assert caught.value.field == faults[0]
            assert faults[0] in str(caught.value)
            first = next(i for i, case in enumerate(items) if case.expect is not None)
            assert caught.value.index == (first if len(items) > 1 else None)
            assert count(conn) == before  # same transaction: still usable, nothing written
            return
        assert write(conn, envelopes, used) == [e.message_id for e in envelopes]
        assert count(conn) == before + len(envelopes)
        for envelope in envelopes:
            check_row(conn, envelope, used)
    finally:
        savepoint.rollback()


def write(conn: Connection, envelopes: list[Envelope], lease: Lease | None) -> list[Any]:
    if len(envelopes) == 1:
        return [emit(conn, envelopes[0], lease=lease, settings=SETTINGS)]
    return emit_many(conn, envelopes, lease=lease, settings=SETTINGS)


# --- the async twins: aio.emit and aio.emit_many keep the same promise ------------------


class AsyncCase:
    """One event loop and one async connection for the module, in an outer transaction."""

    def __init__(self, database_url: str) -> None:
        self.loop = asyncio.Runner()
        self.engine = create_async_engine(sqlalchemy_url(database_url))
        self.conn: AsyncConnection = self.loop.run(self.engine.connect().start())
        self.outer = self.loop.run(self.conn.begin().start())
        self.lease: Lease = self.loop.run(self.conn.run_sync(_async_lease))

    def close(self) -> None:
        self.loop.run(self.outer.rollback())
        self.loop.run(self.conn.close())
        self.loop.run(self.engine.dispose())
        self.loop.close()


def _async_lease(conn: Connection) -> Lease:
    # Its own idempotency key: the sync fixture's run is in another open transaction.
    start_run(conn, workflow="props", workflow_version="1", idempotency_key="props-run-async")
    claimed = claim(conn, worker="props-async-worker", lease_seconds=3600)
    assert claimed is not None
    return claimed.lease


@pytest.fixture(scope="module")
def async_case(module_database_url: str) -> Iterator[AsyncCase]:
    case = AsyncCase(module_database_url)
    try:
        yield case
    finally:
        case.close()


@share(4)
@given(call=st.one_of(batches(), st.sampled_from(KINDS).flatmap(
    lambda kind: emits(None if kind == "valid" else kind))))
def test_async_emits_write_exactly_what_was_given_or_nothing(
    async_case: AsyncCase, call: tuple[bool, list[Case]]
) -> None:
    """``aio.emit`` (one envelope) and ``aio.emit_many`` (2-5): all written, or none."""
    async_case.loop.run(check_call_async(async_case, call))


async def check_call_async(case: AsyncCase, call: tuple[bool, list[Case]]) -> None:
    conn = case.conn
    with_lease, items = call
    used = case.lease if with_lease else None
    savepoint = await conn.begin_nested()
    try:
        before = await conn.run_sync(count)
        if items[0].expect is not None and items[0].expect.startswith("validation:"):
            expect_refused(items[0])
            return
        envelopes = [Envelope(**item.fields) for item in items]
        faults = [item.expect for item in items if item.expect is not None]
        if faults:
            with pytest.raises(InvalidMessage) as caught:
                await write_async(conn, envelopes, used)
            assert caught.value.field == faults[0]
            first = next(i for i, item in enumerate(items) if item.expect is not None)
            assert caught.value.index == (first if len(items) > 1 else None)
            assert await conn.run_sync(count) == before  # still usable, nothing written
            return
        assert await write_async(conn, envelopes, used) == [e.message_id for e in envelopes]
        assert await conn.run_sync(count) == before + len(envelopes)
        for envelope in envelopes:
            await conn.run_sync(check_row, envelope, used)
    finally:
        await savepoint.rollback()


async def write_async(
    conn: AsyncConnection, envelopes: list[Envelope], lease: Lease | None
) -> list[Any]:
    if len(envelopes) == 1:
        return [await aio.emit(conn, envelopes[0], lease=lease, settings=SETTINGS)]
    return await aio.emit_many(conn, envelopes, lease=lease, settings=SETTINGS)
