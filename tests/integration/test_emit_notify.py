"""Wake-up: emit notifies only while a relay is idle and heartbeating, and only on commit;
never with ``notify=False``, which is what lets a transaction be prepared (two-phase commit).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, insert, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio
from outbox.db.tables import relays
from outbox.handle import claim
from outbox.messages.emit import emit, emit_many
from outbox.messages.envelope import Envelope
from outbox.messages.lanes import lane_for
from outbox.runs.lifecycle import start_run
from outbox.settings import OutboxSettings

CHANNEL = OutboxSettings().notify_channel


@pytest.fixture
def listener(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")  # a validated identifier
        yield conn


def received(conn: psycopg.Connection[Any], timeout: float = 0.5) -> list[psycopg.Notify]:
    return list(conn.notifies(timeout=timeout, stop_after=1))


def add_relay(engine: Engine, *, idle: bool, heartbeat_age_seconds: float = 0) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(relays).values(
                relay_id="relay-1",
                idle=idle,
                heartbeat_at=text(f"now() - interval '{heartbeat_age_seconds} seconds'"),
            )
        )


def emit_one(engine: Engine, *, commit: bool = True) -> Envelope:
    envelope = Envelope(topic="orders", type="t", key="order-9", payload={})
    with engine.connect() as conn:
        emit(conn, envelope)
        conn.commit() if commit else conn.rollback()
    return envelope


def test_no_relay_means_no_notification(engine: Engine, listener: Any) -> None:
    emit_one(engine)
    assert received(listener) == []


def test_busy_relay_is_not_notified(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=False)
    emit_one(engine)
    assert received(listener) == []


def test_idle_relay_with_a_stale_heartbeat_is_presumed_dead(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=True, heartbeat_age_seconds=OutboxSettings().relay_idle_seconds + 5)
    emit_one(engine)
    assert received(listener) == []


def test_idle_relay_is_notified_with_the_lane_after_commit(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=True)
    with engine.connect() as conn:
        envelope = Envelope(topic="orders", type="t", key="order-9", payload={})
        emit(conn, envelope)
        assert received(listener, timeout=0.3) == [], "notified before commit"
        conn.commit()
    notes = received(listener)
    lane = lane_for(b"order-9", envelope.message_id, OutboxSettings().lanes)
    assert [(n.channel, n.payload) for n in notes] == [(CHANNEL, str(lane))]


def test_idle_relay_is_not_notified_after_rollback(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=True)
    emit_one(engine, commit=False)
    assert received(listener) == []


def stored(engine: Engine) -> list[uuid.UUID]:
    """The outbox's message ids, in id order."""
    with engine.connect() as conn:
        return list(conn.execute(
            text("SELECT message_id FROM outboxkit.outbox_messages ORDER BY id")).scalars())


def make(key: str = "order-9", **payload: Any) -> Envelope:
    return Envelope(topic="orders", type="t", key=key, payload=payload)


def emit_async(engine: AsyncEngine, envelopes: list[Envelope], many: bool) -> None:
    """aio.emit (one envelope) or aio.emit_many, without notify, in a committed transaction."""

    async def scenario() -> None:
        try:
            async with engine.begin() as conn:
                if many:
                    await aio.emit_many(conn, envelopes, notify=False)
                else:
                    await aio.emit(conn, envelopes[0], notify=False)
        finally:
            await engine.dispose()

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["emit", "emit_many", "aio.emit", "aio.emit_many"])
def test_without_notify_an_idle_relay_is_not_woken_and_the_row_is_written(
    engine: Engine, async_engine: AsyncEngine, listener: Any, how: str
) -> None:
    add_relay(engine, idle=True)
    many = how.endswith("emit_many")
    envelopes = [make(n=1), make(n=2)] if many else [make(n=1)]  # one key: ids in this order
    if how.startswith("aio."):
        emit_async(async_engine, envelopes, many)
    else:
        with engine.begin() as conn:
            plain_emit(conn, envelopes, many)
    assert received(listener) == []
    assert stored(engine) == [e.message_id for e in envelopes]  # the relay's poll finds them


# --- two-phase commit: PREPARE TRANSACTION is refused once a transaction has NOTIFYed -------


@pytest.fixture
def gid(engine: Engine) -> Iterator[str]:
    """The global id of one prepared transaction, rolled back if the test left it prepared:
    a prepared transaction outlives its session, keeps its locks, and blocks dropping the
    test's database."""
    with engine.connect() as conn:
        allowed = int(conn.exec_driver_sql("SHOW max_prepared_transactions").scalar_one())
    # A failure, not a skip: a skipped test proves nothing. outbox.testing's cluster starts
    # with prepared transactions allowed; a server given from outside must allow them too.
    assert allowed > 0, (
        "this server refuses PREPARE TRANSACTION (max_prepared_transactions = 0): restart "
        "outbox.testing's cluster (`python -m outbox.testing.services down`, then `up`), or "
        "set max_prepared_transactions on the server given in OUTBOXKIT_TEST_DATABASE_URL")
    name = f"outboxkit-test-{uuid.uuid4().hex}"
    try:
        yield name
    finally:
        with engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            left = auto.execute(text("SELECT 1 FROM pg_prepared_xacts WHERE gid = :gid"),
                                {"gid": name}).first()
            if left is not None:
                auto.exec_driver_sql(f"ROLLBACK PREPARED '{name}'")  # a uuid: nothing to quote


def claimed_emit(engine: Engine) -> Callable[[Connection, list[Envelope], bool], object]:
    """A run handle's emit / emit_many, on a run claimed (and committed) beforehand."""
    with engine.begin() as conn:
        start_run(conn, workflow="wf", workflow_version="1", idempotency_key="2pc")
        job = claim(conn, worker="w", lease_seconds=60)
    assert job is not None

    def write(conn: Connection, envelopes: list[Envelope], many: bool) -> object:
        work = job.on(conn)
        if many:
            return work.emit_many(envelopes, notify=False)
        return work.emit(envelopes[0], notify=False)

    return write


def plain_emit(conn: Connection, envelopes: list[Envelope], many: bool) -> object:
    if many:
        return emit_many(conn, envelopes, notify=False)
    return emit(conn, envelopes[0], notify=False)


class TestTwoPhaseCommit:
    def test_a_transaction_whose_emit_notified_cannot_be_prepared(
        self, engine: Engine, gid: str
    ) -> None:
        """Why ``notify=False`` exists: with a relay idle, the default emit NOTIFYs, and
        PostgreSQL refuses to prepare the transaction (it is rolled back)."""
        add_relay(engine, idle=True)
        with engine.connect() as conn:
            emit(conn, make())
            with pytest.raises(DBAPIError, match="cannot PREPARE a transaction that has "
                                                 "executed LISTEN, UNLISTEN, or NOTIFY"):
                conn.exec_driver_sql(f"PREPARE TRANSACTION '{gid}'")
            conn.rollback()
        assert stored(engine) == []

    @pytest.mark.parametrize("many", [False, True], ids=["emit", "emit_many"])
    @pytest.mark.parametrize("handle", [False, True], ids=["function", "run-handle"])
    def test_without_notify_it_prepares_and_commit_prepared_writes_the_rows(
        self, engine: Engine, listener: Any, gid: str, many: bool, handle: bool
    ) -> None:
        add_relay(engine, idle=True)
        write = claimed_emit(engine) if handle else plain_emit
        envelopes = [make(n=1), make(n=2)] if many else [make(n=1)]
        with engine.connect() as conn:
            prepared = conn.begin_twophase(gid)
            write(conn, envelopes, many)
            prepared.prepare()
            assert stored(engine) == [], "visible before COMMIT PREPARED"
            prepared.commit()  # COMMIT PREPARED
        assert stored(engine) == [e.message_id for e in envelopes]
        assert received(listener) == []  # no wake-up: the relay's fallback poll finds them

    def test_a_prepared_emit_holds_its_key_until_commit_prepared(
        self, engine: Engine, gid: str
    ) -> None:
        """Per-key order across 2PC: the key's lock passes to the prepared transaction, so
        a later emit of the key draws its id only after COMMIT PREPARED."""
        first, later = make(who="prepared"), make(who="later")
        errors: list[BaseException] = []

        def second() -> None:
            try:
                with engine.begin() as conn:
                    emit(conn, later)
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        with engine.connect() as conn:
            prepared = conn.begin_twophase(gid)
            emit(conn, first, notify=False)
            prepared.prepare()
            thread = threading.Thread(target=second)
            thread.start()
            wait_until_waiting_for_a_key(engine)
            prepared.commit()
            thread.join(timeout=30)
        assert errors == []
        assert stored(engine) == [first.message_id, later.message_id]


def wait_until_waiting_for_a_key(engine: Engine) -> None:
    """Return once some transaction waits for a key's advisory lock."""
    with engine.connect() as watcher:
        for _ in range(250):
            if watcher.execute(text("SELECT count(*) FROM pg_locks "
                                    "WHERE locktype = 'advisory' AND NOT granted")).scalar_one():
                return
            watcher.rollback()  # a fresh snapshot of pg_locks
            threading.Event().wait(0.02)
    raise AssertionError("no transaction ever waited for a key's lock")
