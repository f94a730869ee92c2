"""emit_many in one statement (issue 14): every promise of emit, for a whole batch at once.

The statement count is what changed; the rest checks that nothing emit promises was lost on
the way: validation before any statement, per-key locks in one global order (no deadlock),
ids in the order given within a key, lease fencing, one row per message id, the wake-up.
"""

from __future__ import annotations

import asyncio
import random
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, insert, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import aio
from outbox.db.tables import agent_runs, relays
from outbox.errors import InvalidMessage, LeaseLost
from outbox.messages.emit import emit, emit_many
from outbox.messages.envelope import Envelope
from outbox.messages.lanes import lane_for, ordering_lock_key
from outbox.runs.leases import Lease
from outbox.settings import OutboxSettings

SETTINGS = OutboxSettings()


def make(key: str | None = "k", **fields: Any) -> Envelope:
    values: dict[str, Any] = {"topic": "orders", "type": "order.placed", "payload": {"n": 1}}
    values.update(fields)
    return Envelope(key=key, **values)


def rows(engine: Engine) -> list[Any]:
    """The outbox rows in id order."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT id, message_id, key, lane, run_id FROM outboxkit.outbox_messages "
                     "ORDER BY id")
            )
        )


def start_running_run(engine: Engine, *, token: int = 3, version: int = 7) -> Lease:
    run_id = uuid.uuid4()
    expires = datetime.now(UTC) + timedelta(minutes=5)
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
                lease_expires_at=expires,
            )
        )
    return Lease(run_id, "worker-1", token, version, expires)


def run_async(async_engine: AsyncEngine, scenario: Coroutine[Any, Any, None]) -> None:
    """Run *scenario* in a fresh loop, closing its pooled connections inside that loop."""

    async def main() -> None:
        try:
            await scenario
        finally:
            await async_engine.dispose()

    asyncio.run(main())


def wait_until_blocked_on_a_key(engine: Engine) -> None:
    """Return once some transaction waits for a key's advisory lock."""
    with engine.connect() as watcher:
        for _ in range(250):
            waiting = watcher.execute(
                text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            ).scalar_one()
            if waiting:
                return
            watcher.rollback()  # a fresh snapshot of pg_locks
            threading.Event().wait(0.02)
    raise AssertionError("no transaction ever waited for a key's lock")


def in_thread(work: Callable[[], object], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            work()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


class TestOneStatement:
    @pytest.mark.parametrize("count", [1, 500])
    def test_a_call_sends_one_statement_whatever_the_batch_size(
        self, engine: Engine, statements: list[str], count: int
    ) -> None:
        envelopes = [make(key=f"k{i % 37}", payload={"i": i}) for i in range(count)]
        with engine.begin() as conn:
            before = len(statements)
            ids = emit_many(conn, envelopes)
            assert len(statements) - before == 1
        assert ids == [e.message_id for e in envelopes]
        assert len(rows(engine)) == count

    @pytest.mark.parametrize("count", [1, 500])
    def test_fenced_call_is_one_statement_too(
        self, engine: Engine, statements: list[str], count: int
    ) -> None:
        lease = start_running_run(engine)
        with engine.begin() as conn:
            before = len(statements)
            emit_many(conn, [make(key=f"k{i}") for i in range(count)], lease=lease)
            assert len(statements) - before == 1
        assert {r.run_id for r in rows(engine)} == {lease.run_id}

    def test_async_call_sends_one_statement(
        self, engine: Engine, async_engine: AsyncEngine
    ) -> None:
        sent: list[str] = []
        event.listen(
            async_engine.sync_engine, "before_cursor_execute", lambda *a: sent.append(a[2])
        )
        envelopes = [make(key=f"k{i % 11}", payload={"i": i}) for i in range(500)]

        async def scenario() -> None:
            async with async_engine.begin() as conn:
                before = len(sent)
                assert await aio.emit_many(conn, envelopes) == [e.message_id for e in envelopes]
                assert len(sent) - before == 1

        run_async(async_engine, scenario())
        assert len(rows(engine)) == 500

    def test_nothing_to_emit_sends_nothing(self, engine: Engine, statements: list[str]) -> None:
        with engine.begin() as conn:
            before = len(statements)
            assert emit_many(conn, []) == []
            assert len(statements) == before


class TestOrder:
    def test_ids_follow_the_given_order_within_a_key_and_the_lock_order_across_keys(
        self, engine: Engine
    ) -> None:
        rng = random.Random(14)
        keys = [f"k{i}" for i in range(20)] + [None]
        envelopes = [make(key=rng.choice(keys), payload={"i": i}) for i in range(300)]
        with engine.begin() as conn:
            emit_many(conn, envelopes)
        given: dict[bytes | None, list[uuid.UUID]] = defaultdict(list)
        for envelope in envelopes:
            key = envelope.key.encode() if isinstance(envelope.key, str) else None
            given[key].append(envelope.message_id)
        written: dict[bytes | None, list[uuid.UUID]] = defaultdict(list)
        stored = rows(engine)
        for row in stored:
            written[row.key].append(row.message_id)
        assert written == given
        # Across keys, ids were drawn in lock order: keyless rows first, then by lock key.
        locks = [ordering_lock_key("orders", row.key) for row in stored]
        order = [-(2**63) - 1 if lock is None else lock for lock in locks]
        assert order == sorted(order)

    def test_same_key_rows_of_one_batch_take_consecutive_ids_in_the_given_order(
        self, engine: Engine
    ) -> None:
        envelopes = [make(key="only", payload={"i": i}) for i in range(50)]
        with engine.begin() as conn:
            emit_many(conn, list(reversed(envelopes)))
        stored = rows(engine)
        assert [r.message_id for r in stored] == [e.message_id for e in reversed(envelopes)]
        assert [r.id for r in stored] == list(range(stored[0].id, stored[0].id + 50))


    def test_a_batch_draws_its_ids_only_once_it_holds_the_keys(self, engine: Engine) -> None:
        """T1 holds key k; T2's batch waits for it; meanwhile T1 writes another k row and
        commits first. T2's row must get the higher id: drawn before the lock, it would be
        lower yet committed later, and the relay (in id order) would publish k out of order.
        """
        errors: list[BaseException] = []
        late = make(key="k", payload={"who": "T2"})

        def second() -> None:
            with engine.begin() as conn:
                emit_many(conn, [make(key="other"), late])

        with engine.connect() as first:
            emit(first, make(key="k", payload={"who": "T1"}))
            thread = in_thread(second, errors)
            wait_until_blocked_on_a_key(engine)
            emit(first, make(key="k", payload={"who": "T1 again"}))
            first.commit()
            thread.join(timeout=30)
        assert errors == []
        k_rows = [r for r in rows(engine) if r.key == b"k"]
        assert k_rows[-1].message_id == late.message_id


class TestNoDeadlock:
    def test_a_batch_given_in_the_wrong_order_waits_instead_of_crossing_locks(
        self, engine: Engine
    ) -> None:
        """Deterministic: T1 holds key *low* and will want *high*; T2's batch gives
        [high, low]. Taken in the order given, T2 would hold *high* while waiting for *low*,
        and T1's emit of *high* would close the cycle (PostgreSQL aborts one: deadlock
        detected). Taken in lock order, T2 waits for *low* holding nothing."""
        low, high = sorted(
            ["a", "b"], key=lambda k: ordering_lock_key("orders", k.encode()) or 0
        )
        errors: list[BaseException] = []

        def second() -> None:
            with engine.begin() as conn:
                emit_many(conn, [make(key=high), make(key=low)])

        with engine.connect() as first:
            emit(first, make(key=low))  # T1 holds low until it commits
            thread = in_thread(second, errors)
            wait_until_blocked_on_a_key(engine)
            emit(first, make(key=high))  # would wait for T2 if T2 held high: a deadlock
            first.commit()
            thread.join(timeout=30)
        assert errors == []
        assert [r.key for r in rows(engine)] == [low.encode(), high.encode()] * 2

    def test_overlapping_keys_in_opposite_orders_from_two_transactions(
        self, engine: Engine
    ) -> None:
        """Two writers, each round at the same moment, overlapping keys in opposite orders.

        Taken in the order given, the locks could cross and PostgreSQL would abort one of
        them (deadlock detected); taken in one global order, one writer waits for the other.
        """
        keys = [f"key-{i:03d}" for i in range(400)]
        rounds = 20
        start = threading.Barrier(2, timeout=30)
        errors: list[BaseException] = []

        def writer(reverse: bool, seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(rounds):
                    mine = sorted(rng.sample(keys, 300), reverse=reverse)
                    batch = [make(key=k) for k in mine]
                    start.wait()
                    with engine.begin() as conn:
                        emit_many(conn, batch)
            except BaseException as exc:  # reported by the test
                errors.append(exc)
                start.abort()

        threads = [
            threading.Thread(target=writer, args=(reverse, seed))
            for seed, reverse in enumerate((False, True))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert errors == []
        assert len(rows(engine)) == 2 * rounds * 300


class TestFencing:
    @pytest.mark.parametrize(("token", "version"), [(2, 7), (3, 6)])
    def test_stale_lease_raises_lease_lost_and_writes_nothing(
        self, engine: Engine, token: int, version: int
    ) -> None:
        current = start_running_run(engine, token=3, version=7)
        stale = Lease(current.run_id, "worker-0", token, version, current.expires_at)
        with engine.connect() as conn:
            with pytest.raises(LeaseLost) as caught:
                emit_many(conn, [make(key=f"k{i}") for i in range(20)], lease=stale)
            assert caught.value.run_id == current.run_id
            conn.commit()
        assert rows(engine) == []

    def test_async_session_with_a_stale_lease_writes_nothing(
        self, engine: Engine, async_engine: AsyncEngine
    ) -> None:
        lease = start_running_run(engine)
        stale = Lease(lease.run_id, lease.owner, lease.token - 1, lease.version, lease.expires_at)

        async def scenario() -> None:
            async with AsyncSession(async_engine) as session:
                with pytest.raises(LeaseLost):
                    await aio.emit_many(session, [make(key="a"), make(key="b")], lease=stale)
                await aio.emit_many(session, [make(key="a"), make(key="b")], lease=lease)
                await session.commit()

        run_async(async_engine, scenario())
        assert [r.run_id for r in rows(engine)] == [lease.run_id] * 2


class TestDuplicates:
    def test_the_same_message_id_writes_one_row(self, engine: Engine) -> None:
        first, second = make(key="a"), make(key="b")
        earlier = make(key="c")
        with engine.begin() as conn:
            emit(conn, earlier)
            ids = emit_many(conn, [first, second, first, earlier, second])
        assert ids == [e.message_id for e in (first, second, first, earlier, second)]
        with engine.begin() as conn:
            emit_many(conn, [first, second])  # again, in another transaction
        assert sorted(r.message_id for r in rows(engine)) == sorted(
            e.message_id for e in (first, second, earlier)
        )


class TestValidation:
    def test_a_bad_envelope_at_index_7_sends_nothing_and_writes_nothing(
        self, engine: Engine, statements: list[str]
    ) -> None:
        envelopes = [make(key=f"k{i}", payload={"i": i}) for i in range(10)]
        envelopes[7] = make(key="k7", payload={"text": "nul\x00"})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))  # the caller's transaction has begun
            before = len(statements)
            with pytest.raises(InvalidMessage) as caught:
                emit_many(conn, envelopes)
            assert (caught.value.index, caught.value.field) == (7, "payload.text")
            assert len(statements) == before, "a statement reached the database"
            assert conn.in_transaction()
            emit_many(conn, envelopes[:7])  # the transaction is still usable
            conn.commit()
        assert {r.message_id for r in rows(engine)} == {e.message_id for e in envelopes[:7]}


class TestTransaction:
    def test_never_commits_and_a_session_owns_the_commit(self, engine: Engine) -> None:
        with Session(engine) as session:
            emit_many(session, [make(key="a"), make(key="b")])
            session.rollback()
            kept = [make(key="c"), make(key=None)]
            emit_many(session, kept)
            assert rows(engine) == []  # not committed yet
            session.commit()
        assert {r.message_id for r in rows(engine)} == {e.message_id for e in kept}


class TestWakeUp:
    @pytest.fixture
    def listener(self, database_url: str) -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"LISTEN {SETTINGS.notify_channel}")  # a validated identifier
            yield conn

    def _emit(self, engine: Engine) -> list[Envelope]:
        envelopes = [make(key=f"k{i % 9}", payload={"i": i}) for i in range(60)]
        with engine.begin() as conn:
            emit_many(conn, envelopes)
        return envelopes

    def test_an_idle_relay_hears_each_lane_once(self, engine: Engine, listener: Any) -> None:
        with engine.begin() as conn:
            conn.execute(insert(relays).values(relay_id="relay-1", idle=True))
        envelopes = self._emit(engine)
        lanes = {
            lane_for(str(e.key).encode(), e.message_id, SETTINGS.lanes) for e in envelopes
        }
        heard = list(listener.notifies(timeout=0.5, stop_after=len(lanes) + 1))
        assert sorted(int(n.payload) for n in heard) == sorted(lanes)

    def test_a_busy_relay_is_not_woken(self, engine: Engine, listener: Any) -> None:
        with engine.begin() as conn:
            conn.execute(insert(relays).values(relay_id="relay-1", idle=False))
        self._emit(engine)
        assert list(listener.notifies(timeout=0.5, stop_after=1)) == []


class TestKeyBound:
    """Each distinct key holds a lock in the server's shared lock table until commit: a call
    carries at most ``emit_many_max_keys`` of them, checked before anything is sent."""

    BOUND = OutboxSettings(emit_many_max_keys=5)

    def batch(self, keys: int) -> list[Envelope]:
        """*keys* distinct keys, three messages each, and keyless ones (which lock nothing)."""
        keyed = [make(key=f"k{i}", payload={"n": n}) for n in range(3) for i in range(keys)]
        return keyed + [make(key=None) for _ in range(4)]

    def test_a_call_over_the_bound_is_refused_before_anything_is_sent(
        self, engine: Engine, statements: list[str]
    ) -> None:
        earlier = make(key="earlier")
        with engine.connect() as conn:
            emit(conn, earlier)  # the caller's transaction has begun, and stays usable
            before = len(statements)
            with pytest.raises(InvalidMessage) as caught:
                emit_many(conn, self.batch(6), settings=self.BOUND)
            assert len(statements) == before, "a statement reached the database"
            conn.commit()
        refused = caught.value
        assert (refused.field, refused.index) == ("envelopes", None)
        assert "6 distinct (topic, key) pairs" in str(refused)
        assert "at most 5 (emit_many_max_keys, OUTBOXKIT_EMIT_MANY_MAX_KEYS)" in str(refused)
        assert "several transactions" in str(refused)
        assert "nothing was sent" in str(refused)
        assert [r.message_id for r in rows(engine)] == [earlier.message_id]

    def test_a_call_at_the_bound_writes_every_message(self, engine: Engine) -> None:
        envelopes = self.batch(5)  # 19 messages, 5 keys
        with engine.begin() as conn:
            assert emit_many(conn, envelopes, settings=self.BOUND) == [
                e.message_id for e in envelopes
            ]
        assert len(rows(engine)) == len(envelopes)

    def test_the_async_twin_is_bounded_too(
        self, engine: Engine, async_engine: AsyncEngine
    ) -> None:
        async def scenario() -> None:
            async with async_engine.begin() as conn:
                with pytest.raises(InvalidMessage, match="6 distinct"):
                    await aio.emit_many(conn, self.batch(6), settings=self.BOUND)
                await aio.emit_many(conn, self.batch(5), settings=self.BOUND)

        run_async(async_engine, scenario())
        assert len(rows(engine)) == 19

    def test_the_default_bound_is_one_lock_per_key_and_a_small_share_of_the_table(
        self, engine: Engine
    ) -> None:
        """At the default bound a call works and holds exactly one lock per distinct key,
        which the bound counts. The shared lock table of a server with PostgreSQL's defaults
        (max_locks_per_transaction 64 x max_connections 100) has room for ~6,400 locks for
        every session together: one call at the bound takes at most a sixth of it."""
        bound = SETTINGS.emit_many_max_keys
        assert bound * 6 <= 64 * 100
        envelopes = [make(key=f"key-{i}") for i in range(bound)] + [make(key="key-0")]
        with engine.begin() as conn:
            emit_many(conn, envelopes)
            held = conn.execute(
                text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                     "AND pid = pg_backend_pid()")
            ).scalar_one()
            assert held == bound
            with pytest.raises(InvalidMessage, match=f"{bound + 1} distinct"):
                emit_many(conn, [*envelopes, make(key="one-too-many")])
        assert len(rows(engine)) == bound + 1
