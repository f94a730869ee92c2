"""emit against real PostgreSQL: transactional, fenced, validated before writing, async too."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import aio
from outbox.db.tables import agent_runs, outbox_messages
from outbox.errors import InvalidMessage, LeaseLost
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from outbox.runs.leases import Lease
from outbox.settings import OutboxSettings


def make(**fields: Any) -> Envelope:
    values: dict[str, Any] = {"topic": "orders", "type": "order.placed", "payload": {"n": 1}}
    values.update(fields)
    return Envelope(**values)


def count_messages(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(outbox_messages)).scalar_one()


def start_running_run(engine: Engine, *, token: int = 3, version: int = 7) -> Lease:
    run_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            insert(agent_runs).values(
                id=run_id,
                workflow="wf",
                workflow_version="1",
                state="running",
                idempotency_key=str(run_id),
                lease_owner="worker-1",
                lease_token=token,
                version=version,
                lease_expires_at=datetime.now(UTC) + timedelta(minutes=5),
            )
        )
    return Lease(run_id, "worker-1", token, version, datetime.now(UTC) + timedelta(minutes=5))


class TestTransaction:
    def test_commit_makes_the_message_visible_with_its_exact_bytes(self, engine: Engine) -> None:
        envelope = make(key="order-1", payload={"z": 1, "a": [True, None]})
        with engine.begin() as conn:
            assert emit(conn, envelope) == envelope.message_id
        with engine.connect() as conn:
            row = conn.execute(select(outbox_messages)).one()
        assert row.message_id == envelope.message_id
        assert row.payload == b'{"z":1,"a":[true,null]}'
        assert row.key == b"order-1"
        assert row.xid is not None  # the writing transaction's id: what the relay reads by
        with engine.connect() as conn:
            status = conn.execute(text("SELECT status FROM outboxkit.message_status")).scalar()
        assert status == "pending"
        assert row.headers["message-id"] == str(envelope.message_id)
        assert 0 <= row.lane < OutboxSettings().lanes

    def test_rollback_leaves_no_message(self, engine: Engine) -> None:
        with engine.connect() as conn:
            emit(conn, make())
            assert conn.execute(select(func.count()).select_from(outbox_messages)).scalar() == 1
            conn.rollback()
        assert count_messages(engine) == 0

    def test_emit_never_commits_the_callers_transaction(self, engine: Engine) -> None:
        with engine.connect() as conn:
            emit(conn, make())
            assert conn.in_transaction()
            assert count_messages(engine) == 0  # another connection sees nothing yet
            conn.commit()
        assert count_messages(engine) == 1

    def test_session_is_accepted_and_owns_the_commit(self, engine: Engine) -> None:
        with Session(engine) as session:
            emit(session, make())
            session.rollback()
            emit(session, make())
            session.commit()
        assert count_messages(engine) == 1

    def test_same_message_id_twice_is_one_row(self, engine: Engine) -> None:
        envelope = make()
        with engine.begin() as conn:
            emit(conn, envelope)
            emit(conn, envelope)
        with engine.begin() as conn:
            emit(conn, envelope)
        assert count_messages(engine) == 1

    def test_schema_name_comes_from_settings(self, engine: Engine) -> None:
        from outbox.db.migrate import migrate  # noqa: PLC0415

        custom = OutboxSettings(schema_name="agents_b")
        migrate(engine, settings=custom)
        with engine.begin() as conn:
            emit(conn, make(), settings=custom)
        with engine.connect() as conn:
            moved = conn.execution_options(schema_translate_map={"outboxkit": "agents_b"})
            assert moved.execute(select(func.count()).select_from(outbox_messages)).scalar() == 1
        assert count_messages(engine) == 0


class TestRejectedBeforeWriting:
    @pytest.mark.parametrize(
        ("fields", "field"),
        [
            ({"topic": "bad topic"}, "topic"),
            ({"topic": ".."}, "topic"),
            ({"payload": {"x": {1, 2}}}, "payload"),
            ({"payload": {"x": "nul\x00"}}, "payload.x"),
            ({"key": "k\x00"}, "key"),
            ({"key": "\udc80"}, "key"),
            ({"causation_id": "c\x00"}, "headers['causation-id']"),
            ({"headers": {"h": "\ud800"}}, "headers['h']"),
            ({"payload": "x" * 2000}, "message"),
            ({"topic": "ordered", "key": None}, "key"),
        ],
    )
    def test_bad_input_raises_and_sends_no_statement(
        self, engine: Engine, statements: list[str], fields: dict[str, Any], field: str
    ) -> None:
        settings = OutboxSettings(max_message_bytes=1024, ordered_topics=frozenset({"ordered"}))
        with engine.connect() as conn:
            conn.execute(select(1))  # the caller's transaction has begun and done work
            sent_before = len(statements)
            with pytest.raises(InvalidMessage) as caught:
                emit(conn, make(**fields), settings=settings)
            assert caught.value.field == field
            assert len(statements) == sent_before, "a statement reached the database"
            assert conn.in_transaction()
            emit(conn, make(), settings=settings)  # the transaction is still usable
            conn.commit()
        assert count_messages(engine) == 1

    def test_run_id_that_disagrees_with_the_lease(self, engine: Engine) -> None:
        lease = start_running_run(engine)
        with engine.begin() as conn, pytest.raises(InvalidMessage) as caught:
            emit(conn, make(run_id=uuid.uuid4()), lease=lease)
        assert caught.value.field == "run_id"
        assert count_messages(engine) == 0


class TestLeaseFencing:
    def test_current_lease_writes_with_the_run_id(self, engine: Engine) -> None:
        lease = start_running_run(engine)
        with engine.begin() as conn:
            emit(conn, make(), lease=lease)
        with engine.connect() as conn:
            row = conn.execute(select(outbox_messages)).one()
        assert row.run_id == lease.run_id
        assert row.headers["run-id"] == str(lease.run_id)

    @pytest.mark.parametrize(("token", "version"), [(2, 7), (3, 6), (4, 8)])
    def test_stale_lease_raises_lease_lost_and_writes_nothing(
        self, engine: Engine, token: int, version: int
    ) -> None:
        current = start_running_run(engine, token=3, version=7)
        stale = Lease(current.run_id, "worker-0", token, version, current.expires_at)
        with engine.connect() as conn:
            with pytest.raises(LeaseLost) as caught:
                emit(conn, make(), lease=stale)
            assert caught.value.run_id == current.run_id
            assert caught.value.held_token == token
            conn.commit()
        assert count_messages(engine) == 0

    def test_lease_of_a_missing_run_is_lost(self, engine: Engine) -> None:
        ghost = Lease(uuid.uuid4(), "w", 1, 1, datetime.now(UTC))
        with engine.begin() as conn, pytest.raises(LeaseLost):
            emit(conn, make(), lease=ghost)
        assert count_messages(engine) == 0

    def test_fenced_emit_is_one_statement(self, engine: Engine, statements: list[str]) -> None:
        lease = start_running_run(engine)
        with engine.begin() as conn:
            before = len(statements)
            emit(conn, make(key="k"), lease=lease)
            assert len(statements) - before == 1


def run_async(async_engine: AsyncEngine, scenario: Coroutine[Any, Any, None]) -> None:
    """Run *scenario* in a fresh loop, closing its pooled connections inside that loop."""

    async def main() -> None:
        try:
            await scenario
        finally:
            await async_engine.dispose()

    asyncio.run(main())


class TestAsync:
    def test_async_connection_commit_and_rollback(
        self, engine: Engine, async_engine: AsyncEngine
    ) -> None:
        async def scenario() -> None:
            async with async_engine.connect() as conn:
                await aio.emit(conn, make(payload="rolled back"))
                await conn.rollback()
            async with async_engine.begin() as conn:
                await aio.emit(conn, make(payload="kept"))

        run_async(async_engine, scenario())
        with engine.connect() as conn:
            assert conn.execute(select(outbox_messages.c.payload)).scalars().all() == [b'"kept"']

    def test_async_session_with_a_stale_lease_writes_nothing(
        self, engine: Engine, async_engine: AsyncEngine
    ) -> None:
        lease = start_running_run(engine)
        stale = Lease(lease.run_id, lease.owner, lease.token - 1, lease.version, lease.expires_at)

        async def scenario() -> None:
            async with AsyncSession(async_engine) as session:
                with pytest.raises(LeaseLost):
                    await aio.emit(session, make(), lease=stale)
                await aio.emit(session, make(), lease=lease)
                await session.commit()

        run_async(async_engine, scenario())
        assert count_messages(engine) == 1

    def test_async_rejects_bad_input_before_writing(
        self, engine: Engine, async_engine: AsyncEngine
    ) -> None:
        async def scenario() -> None:
            async with async_engine.begin() as conn:
                with pytest.raises(InvalidMessage):
                    await aio.emit(conn, make(topic="no spaces"))

        run_async(async_engine, scenario())
        assert count_messages(engine) == 0


def _sync_connection_type_check(conn: Connection) -> None:
    """Typing only: emit accepts a plain Connection."""
    emit(conn, make())


class TestEmitMany:
    """Several keys in one transaction, from many transactions at once."""

    def test_concurrent_multi_key_transactions_in_random_orders_do_not_deadlock(
        self, engine: Engine
    ) -> None:
        import random  # noqa: PLC0415
        import threading  # noqa: PLC0415

        from outbox.messages.emit import emit_many  # noqa: PLC0415

        errors: list[BaseException] = []

        def writer(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    keys = rng.sample([f"k{i}" for i in range(8)], 6)  # random order
                    with engine.begin() as conn:
                        emit_many(conn, [Envelope(topic="many", type="t", key=k, payload={})
                                         for k in keys])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        with engine.connect() as conn:
            assert conn.execute(text(
                "SELECT count(*) FROM outboxkit.outbox_messages")).scalar_one() == 6 * 40 * 6

    def test_one_invalid_envelope_writes_nothing_and_ids_keep_the_given_order(
        self, engine: Engine
    ) -> None:
        from outbox.messages.emit import emit_many  # noqa: PLC0415

        good = [Envelope(topic="many", type="t", key=f"k{i}", payload={"i": i}) for i in range(3)]
        bad = Envelope(topic="bad topic!", type="t", key="k", payload={})
        with engine.begin() as conn:
            with pytest.raises(InvalidMessage):
                emit_many(conn, [*good, bad])
            assert conn.execute(text(
                "SELECT count(*) FROM outboxkit.outbox_messages")).scalar_one() == 0
            ids = emit_many(conn, good)
        assert ids == [g.message_id for g in good]

    def test_the_refusal_says_which_envelope_was_bad(self, engine: Engine) -> None:
        """Issue #13: emit_many named the field, not which of the envelopes it was in."""
        from outbox.messages.emit import emit_many  # noqa: PLC0415

        good = [make(key=f"k{i}", payload={"i": i}) for i in range(4)]
        bad = make(key="k", payload={"items": [{"name": "nul\x00"}]})
        with engine.begin() as conn:
            with pytest.raises(InvalidMessage) as caught:
                emit_many(conn, [*good[:2], bad, *good[2:]])
            assert caught.value.index == 2
            assert caught.value.field == "payload.items[0].name"
            assert str(caught.value).startswith(
                "invalid message: envelopes[2]: payload.items[0].name: contains a NUL"
            )
            assert isinstance(caught.value.__cause__, InvalidMessage)  # the one encode raised
        assert count_messages(engine) == 0

    def test_the_cause_of_a_refusal_stays_attached_in_a_batch(self, engine: Engine) -> None:
        from outbox.messages.emit import emit_many  # noqa: PLC0415

        with engine.begin() as conn, pytest.raises(InvalidMessage) as caught:
            emit_many(conn, [make(), make(key="\udc80")])
        assert (caught.value.index, caught.value.field) == (1, "key")
        assert isinstance(caught.value.__cause__, UnicodeEncodeError)

    @pytest.mark.parametrize(
        ("given", "field", "index"),
        [
            ({"topic": "orders", "type": "t", "payload": {}}, "envelopes", None),
            ([make(), {"topic": "orders"}], "envelope", 1),
            (make(), "envelopes", None),
        ],
    )
    def test_something_that_is_not_an_envelope_is_refused_by_name(
        self, engine: Engine, given: Any, field: str, index: int | None
    ) -> None:
        from outbox.messages.emit import emit_many  # noqa: PLC0415

        with engine.begin() as conn, pytest.raises(InvalidMessage) as caught:
            emit_many(conn, given)
        assert (caught.value.field, caught.value.index) == (field, index)
        assert "Envelope" in caught.value.reason
        assert count_messages(engine) == 0

    def test_emit_of_something_that_is_not_an_envelope_is_refused(self, engine: Engine) -> None:
        with engine.begin() as conn, pytest.raises(InvalidMessage) as caught:
            emit(conn, {"topic": "orders", "type": "t", "payload": {}})  # type: ignore[arg-type]
        assert caught.value.field == "envelope"
        assert "is a dict, not an outbox.Envelope" in str(caught.value)

    def test_async_batch_refusal_says_which_envelope_was_bad(
        self, engine: Engine, async_engine: AsyncEngine
    ) -> None:

        async def scenario() -> None:
            async with async_engine.begin() as conn:
                with pytest.raises(InvalidMessage) as caught:
                    await aio.emit_many(conn, [make(), make(), make(topic="x" * 5000)])
                assert (caught.value.index, caught.value.field) == (2, "topic")
                assert "(5000 characters) is too long" in str(caught.value)

        run_async(async_engine, scenario())
        assert count_messages(engine) == 0
