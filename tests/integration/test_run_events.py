"""A run's events (outbox/runs/events.py, migration 0019) against real PostgreSQL: numbered
in commit order, so a reader that resumes after the last number it saw misses nothing and
sees nothing twice, however its writers interleave; what rolled back is never an event; the
follower ends with the run; retention takes the events with the run's log."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import (
    App,
    ApprovalInvalid,
    ConfigurationError,
    Envelope,
    RunNotFound,
    call_digest,
)
from outbox.db.dsn import sqlalchemy_url
from outbox.db.tables import agent_runs, run_event_heads, run_events
from outbox.runs import retention
from outbox.runs.approvals import request_approval
from outbox.runs.events import RunEvent
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import claim, save_checkpoint, start_run, transition
from tests.integration.worker_support import wait_for

APP = App()
ENTRY = {"op": "agent.model.request", "result": {"parts": [{"content": "the plan"}]}}


def _running(engine: Engine, key: str = "events") -> Lease:
    """A claimed run (events 1 and 2: queued, running), its lease committed."""
    with engine.begin() as conn:
        start_run(conn, workflow="wf", workflow_version="1", idempotency_key=key)
    with engine.begin() as conn:
        got = claim(conn, worker="w", lease_seconds=120)
    assert got is not None
    return got.lease


def _read(engine: Engine, run_id: uuid.UUID, after: int = 0) -> list[RunEvent]:
    with engine.connect() as conn:
        return APP.run_events(conn, run_id, after=after, limit=1000)


def _effect(run_id: uuid.UUID, n: int) -> Envelope:
    return Envelope(topic="orders", type="order.submit", key=f"k{n}", payload={"n": n},
                    run_id=run_id)


def _waiting_locks(engine: Engine, at_least: int) -> None:
    """Until *at_least* lock requests in this database wait (the writers are blocked)."""
    def blocked() -> bool:
        with engine.connect() as conn:
            return conn.scalar(text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()")) >= at_least
    wait_for(blocked, what=f"{at_least} blocked lock requests")


class TestNothingThatRolledBack:
    def test_a_rolled_back_step_is_no_event_and_takes_no_number(self, engine: Engine) -> None:
        """A log entry, a message and a move in a transaction that rolls back: no event, and
        the next committed event takes the next number (no gap)."""
        lease = _running(engine)
        with engine.connect() as conn:
            saved = save_checkpoint(conn, lease, {"n": 1}, log={0: ENTRY})
            APP.emit(conn, _effect(lease.run_id, 1))
            transition(conn, saved, "waiting", step="asked")
            conn.rollback()
        assert [(e.seq, e.kind) for e in _read(engine, lease.run_id)] == [
            (1, "state"), (2, "state")]
        with engine.begin() as conn:
            save_checkpoint(conn, lease, {"n": 1}, log={0: ENTRY})
        assert [(e.seq, e.kind) for e in _read(engine, lease.run_id, after=2)] == [
            (3, "model_response")]

    def test_numbers_taken_at_prepare_are_given_back_by_a_rollback(
            self, engine: Engine, gid: str) -> None:
        """Two-phase commit numbers the events at PREPARE; ROLLBACK PREPARED returns the
        numbers (the head's change rolls back with them), and nobody ever saw them."""
        lease = _running(engine)
        with engine.connect() as conn:
            APP.emit(conn, _effect(lease.run_id, 1), notify=False)
            conn.exec_driver_sql(f"PREPARE TRANSACTION '{gid}'")
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(run_events)
                               .where(run_events.c.run_id == lease.run_id)) == 2
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                f"ROLLBACK PREPARED '{gid}'")
        with engine.begin() as conn:
            APP.emit(conn, _effect(lease.run_id, 2))
        events = _read(engine, lease.run_id, after=2)
        assert [(e.seq, e.kind, e.data["key"]) for e in events] == [(3, "effect_sent", "k2")]


@pytest.fixture
def gid(engine: Engine) -> Iterator[str]:
    """A prepared transaction's global id, rolled back if the test left it prepared."""
    name = f"outboxkit-test-{uuid.uuid4().hex}"
    try:
        yield name
    finally:
        with engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            if auto.scalar(text("SELECT 1 FROM pg_prepared_xacts WHERE gid = :g"), {"g": name}):
                auto.exec_driver_sql(f"ROLLBACK PREPARED '{name}'")


@pytest.fixture
def gate(engine: Engine) -> Iterator[Any]:
    """A table whose row holds its transaction at COMMIT, after the transaction's events
    were numbered, until the test opens the gate (an advisory lock the test holds)."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE gate (n int)")
        conn.exec_driver_sql(
            "CREATE FUNCTION gate_wait() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "PERFORM pg_advisory_xact_lock(424242); RETURN NULL; END $$")
        # "zz": deferred triggers of one event fire by name; this one after the events'.
        conn.exec_driver_sql(
            "CREATE CONSTRAINT TRIGGER zz_gate AFTER INSERT ON gate DEFERRABLE INITIALLY "
            "DEFERRED FOR EACH ROW EXECUTE FUNCTION gate_wait()")
    holder = engine.connect()
    holder.exec_driver_sql("SELECT pg_advisory_xact_lock(424242)")
    try:
        yield holder
    finally:
        holder.rollback()
        holder.close()


class TestCommitOrder:
    def test_a_writer_numbered_first_but_committing_last_is_not_missed(
            self, engine: Engine, gate: Any) -> None:
        """Writer A's event is numbered, then A is held inside its COMMIT; writer B commits
        meanwhile. A reader that reads while both are in flight, and resumes after the last
        number it saw, gets A's event then B's: B waited for A's commit for its number."""
        lease = _running(engine)
        seen = _read(engine, lease.run_id)
        errors: list[BaseException] = []

        def write(n: int, held: bool) -> None:
            try:
                with engine.begin() as conn:
                    APP.emit(conn, _effect(lease.run_id, n))
                    if held:
                        conn.exec_driver_sql("INSERT INTO gate VALUES (1)")
            except BaseException as exc:  # the test fails on any writer's error
                errors.append(exc)

        first = threading.Thread(target=write, args=(1, True))
        first.start()
        _waiting_locks(engine, 1)  # A numbered its event, and waits at the gate
        second = threading.Thread(target=write, args=(2, False))
        second.start()
        _waiting_locks(engine, 2)  # B waits for A's number to commit
        seen += _read(engine, lease.run_id, after=seen[-1].seq)  # nothing has committed
        gate.rollback()  # open the gate
        first.join(timeout=10)
        second.join(timeout=10)
        assert not errors, errors
        seen += _read(engine, lease.run_id, after=seen[-1].seq)
        assert [(e.seq, e.kind, e.data.get("key")) for e in seen] == [
            (1, "state", None), (2, "state", None), (3, "effect_sent", "k1"),
            (4, "effect_sent", "k2")]

    def test_concurrent_writers_give_a_follower_every_event_once_in_order(
            self, engine: Engine) -> None:
        """Eight writers commit 160 transactions on one run in whatever order their random
        pauses make (a message, or a message and a log entry, each); a reader resuming after
        the last number it saw, again and again meanwhile, ends with every event, numbered
        1..n without a gap, each once."""
        lease = _running(engine)
        seen: list[RunEvent] = _read(engine, lease.run_id)
        done = threading.Event()
        errors: list[BaseException] = []
        log_seq = iter(range(10_000))
        log_lock = threading.Lock()

        def write(worker: int) -> None:
            rng = random.Random(worker)
            try:
                for i in range(20):
                    with engine.begin() as conn:
                        APP.emit(conn, _effect(lease.run_id, worker * 100 + i))
                        if i % 2:  # a log entry too, as a worker saving without a lease
                            with log_lock:
                                seq = next(log_seq)
                            conn.exec_driver_sql(
                                "INSERT INTO outboxkit.run_log VALUES (%(r)s, %(s)s, '{}')",
                                {"r": lease.run_id, "s": seq})
                        time.sleep(rng.random() * 0.01)
            except BaseException as exc:  # the test fails on any writer's error
                errors.append(exc)

        writers = [threading.Thread(target=write, args=(w,)) for w in range(8)]
        for thread in writers:
            thread.start()

        def follow() -> None:
            while not done.is_set():
                seen.extend(_read(engine, lease.run_id, after=seen[-1].seq))

        reader = threading.Thread(target=follow)
        reader.start()
        for thread in writers:
            thread.join(timeout=60)
        done.set()
        reader.join(timeout=10)
        assert not errors, errors
        seen.extend(_read(engine, lease.run_id, after=seen[-1].seq))
        total = 2 + 8 * 20 + 8 * 10
        assert [e.seq for e in seen] == list(range(1, total + 1))
        assert [e.seq for e in _read(engine, lease.run_id)] == list(range(1, total + 1))


class TestLockOrder:
    def test_a_revoke_and_a_worker_spending_the_approval_do_not_deadlock(
            self, engine: Engine) -> None:
        """The worker holds its run's row (a save), then spends the approval beside the
        effect's emit; a person revokes that approval meanwhile, which is an event of the
        run. The revoke's number is taken at its COMMIT, after its own locks, from a row only
        events lock: it waits for nothing the worker holds and commits; the spend, which
        waited for it, is refused (revoked), and nothing is sent."""
        with engine.begin() as conn:
            start_run(conn, workflow="wf", workflow_version="1", idempotency_key="pay")
            job = APP.claim(conn, worker="w", lease_seconds=120)
        assert job is not None
        digest = call_digest("pay", {"amount": 5})
        with engine.begin() as conn:
            approval = APP.request_approval(
                conn, job.run.id, scope={"tool": "pay", "args": {"amount": 5}},
                expires_at=timedelta(hours=1), digest=digest)
        with engine.begin() as conn:
            APP.grant(conn, approval.id, by="ann", digest=digest)
        refused: list[BaseException] = []
        worker = engine.connect()
        try:
            work = job.on(worker)
            work.save_checkpoint({"n": 1}, log={0: ENTRY})  # the run's row, until commit
            revoker = engine.connect()
            # It must never wait: with the number taken at its statement, it would wait for
            # the worker's, which waits for it (a deadlock PostgreSQL would break).
            revoker.exec_driver_sql("SET lock_timeout = '5s'")
            APP.revoke(revoker, approval.id, by="ann", reason="too much")  # its row

            def spend() -> None:
                try:
                    message_id = work.emit(_effect(job.run.id, 1))
                    work.spend_approval(approval.id, digest=digest, message_id=message_id)
                except BaseException as exc:  # the refusal, or a deadlock that fails the test
                    refused.append(exc)
                    worker.rollback()

            spending = threading.Thread(target=spend)
            spending.start()
            _waiting_locks(engine, 1)  # the spend waits for the revoke
            revoker.commit()
            revoker.close()
            spending.join(timeout=10)
            assert not spending.is_alive()
        finally:
            worker.close()
        assert len(refused) == 1
        assert isinstance(refused[0], ApprovalInvalid), refused
        assert "revoked" in str(refused[0])
        kinds = [e.kind for e in _read(engine, job.run.id)]
        assert kinds == ["state", "state", "approval_requested", "approval_granted",
                         "approval_revoked"]  # the save and the emit rolled back with it

    def test_a_transaction_that_fails_at_commit_leaves_the_run_writable(
            self, engine: Engine) -> None:
        """A REPEATABLE READ transaction whose run got an event since its snapshot fails at
        COMMIT with a serialization error (retry it), writing nothing."""
        lease = _running(engine)
        with engine.connect() as conn:
            late = conn.execution_options(isolation_level="REPEATABLE READ")
            late.scalar(text("SELECT 1"))  # its snapshot
            with engine.begin() as other:
                APP.emit(other, _effect(lease.run_id, 1))
            APP.emit(late, _effect(lease.run_id, 2))
            with pytest.raises(DBAPIError, match="could not serialize"):
                late.commit()
        assert [e.data.get("key") for e in _read(engine, lease.run_id, after=2)] == ["k1"]


class TestKinds:
    def test_each_kind_says_what_happened_and_a_log_entry_by_its_operation(
            self, engine: Engine) -> None:
        lease = _running(engine)
        with engine.begin() as conn:
            saved = save_checkpoint(conn, lease, {"n": 1}, log={
                0: ENTRY, 1: {"op": "call_tool:call-7", "result": "x" * 500},
                2: ["an", "entry", "of", "another", "shape"]})
            message_id = APP.emit(conn, _effect(lease.run_id, 1))
            approval = request_approval(conn, lease.run_id, scope={"tool": "pay", "max": 9},
                                        expires_at=timedelta(hours=1))
            transition(conn, saved, "waiting", step="asked", reason="needs the payment")
        with engine.begin() as conn:
            APP.grant(conn, approval.id, by="ann")
        with engine.begin() as conn:
            APP.confirm(conn, run_id=lease.run_id, confirmation_id=str(message_id),
                        outcome="done", evidence={"ref": "PO-1"}, actor="orders")
        events = _read(engine, lease.run_id)
        assert [e.kind for e in events] == [
            "state", "state", "model_response", "tool_result", "log", "effect_sent",
            "approval_requested", "state", "approval_granted", "effect_confirmed", "state",
            "state"]
        data = [e.data for e in events]
        assert data[2] == {"op": "agent.model.request", "log_seq": 0, "truncated": False,
                           "summary": '{"parts": [{"content": "the plan"}]}'}
        assert data[3]["op"] == "call_tool:call-7"
        assert data[3]["truncated"]
        assert len(data[3]["summary"]) == 200
        assert data[4]["op"] is None
        assert data[5] == {"message_id": str(message_id), "topic": "orders",
                           "type": "order.submit", "key": "k1"}
        assert data[6]["approval_id"] == str(approval.id)
        assert data[6]["summary"] == '{"max": 9, "tool": "pay"}'
        assert data[7] == {"from": "running", "to": "waiting", "step": "asked",
                           "reason": "needs the payment", "actor": "w"}
        assert data[8] == {"approval_id": str(approval.id), "by": "ann", "reason": None}
        assert data[9] == {"confirmation_id": str(message_id), "outcome": "done",
                           "actor": "orders"}
        assert data[11]["to"] == "done"
        assert [e.seq for e in events] == list(range(1, 13))

    def test_a_rewritten_log_entry_is_an_event_again_and_an_unchanged_one_is_not(
            self, engine: Engine) -> None:
        lease = _running(engine)
        with engine.begin() as conn:
            lease = save_checkpoint(conn, lease, {"n": 1}, log={0: {"op": "x", "result": 1}})
        with engine.begin() as conn:
            lease = save_checkpoint(conn, lease, {"n": 1}, log={0: {"op": "x", "result": 1}})
        with engine.begin() as conn:
            save_checkpoint(conn, lease, {"n": 1}, log={0: {"op": "x", "result": 2}})
        events = _read(engine, lease.run_id, after=2)
        assert [(e.seq, e.kind, e.data["summary"]) for e in events] == [
            (3, "log", "2"), (4, "log", "2")]  # both show the entry as it is now

    def test_a_message_without_a_run_is_no_event(self, engine: Engine) -> None:
        with engine.begin() as conn:
            APP.emit(conn, Envelope(topic="t", type="t", key="k", payload={}))
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(run_events)) == 0
            assert conn.scalar(select(func.count()).select_from(run_event_heads)) == 0

    def test_a_spent_approval_is_an_event(self, engine: Engine) -> None:
        """Migration 0018's spend: the approval's spent_at set, with its message."""
        lease = _running(engine)
        message_id = uuid.uuid4()
        with engine.begin() as conn:
            approval = request_approval(conn, lease.run_id, scope={"tool": "pay"},
                                        expires_at=timedelta(hours=1))
        with engine.begin() as conn:
            conn.execute(text(
                "UPDATE outboxkit.approvals SET granted_at = now(), granted_by = 'ann', "
                "digest = 'sha256:' || repeat('0', 64) WHERE id = :id"), {"id": approval.id})
        with engine.begin() as conn:
            conn.execute(text(
                "UPDATE outboxkit.approvals SET spent_at = now(), spent_message_id = :m "
                "WHERE id = :id"), {"id": approval.id, "m": message_id})
        last = _read(engine, lease.run_id)[-1]
        assert (last.kind, last.data) == (
            "approval_spent", {"approval_id": str(approval.id), "message_id": str(message_id)})

    def test_a_bad_position_is_refused_before_anything_is_read(self, engine: Engine) -> None:
        with engine.connect() as conn:
            for after, limit in ((-1, 10), (0, 0), (0, 1001), (True, 10)):
                with pytest.raises(ConfigurationError, match=r"after|limit"):
                    APP.run_events(conn, uuid.uuid4(), after=after, limit=limit)


class TestFollowing:
    def test_the_follower_yields_each_event_as_it_commits_and_ends_with_the_run(
            self, engine: Engine) -> None:
        lease = _running(engine)
        got: list[RunEvent] = []

        def steps() -> None:
            current = lease
            for n in range(3):
                time.sleep(0.2)
                with engine.begin() as conn:
                    current = save_checkpoint(conn, current, {"n": n}, log={n: ENTRY})
            with engine.begin() as conn:
                transition(conn, current, "done", evidence={"ok": True})

        async def follow() -> None:
            writer = asyncio.create_task(asyncio.to_thread(steps))
            async for event in APP.follow_run_events(engine, lease.run_id, poll=0.05):
                got.append(event)
            await writer

        asyncio.run(asyncio.wait_for(follow(), timeout=20))
        assert [e.seq for e in got] == list(range(1, 7))
        assert [e.kind for e in got][2:] == ["model_response"] * 3 + ["state"]
        assert got[-1].data["to"] == "done"

    def test_the_follower_on_an_async_engine_resumes_after_a_number(
            self, engine: Engine, database_url: str) -> None:
        lease = _running(engine)
        with engine.begin() as conn:
            transition(conn, lease, "failed", reason="cancelled")

        async def follow() -> list[list[int]]:
            async_engine = create_async_engine(sqlalchemy_url(database_url))
            try:
                return [[e.seq async for e in APP.follow_run_events(
                    async_engine, lease.run_id, after=after, poll=0.05)] for after in (0, 2, 3)]
            finally:
                await async_engine.dispose()

        # From the start; after 2; after the last (finished, nothing after: it ends at once).
        assert asyncio.run(follow()) == [[1, 2, 3], [3], []]

    def test_following_an_unknown_run_fails_at_once(self, engine: Engine) -> None:
        async def follow() -> None:
            async for _ in APP.follow_run_events(engine, uuid.uuid4()):
                pass

        with pytest.raises(RunNotFound):
            asyncio.run(follow())


def test_retention_deletes_a_purged_runs_events_and_keeps_its_numbering(
        engine: Engine) -> None:
    old = _running(engine, "old")
    young = _running(engine, "young")
    with engine.begin() as conn:
        transition(conn, old, "done", evidence={"ok": True})
        conn.execute(update(agent_runs).where(agent_runs.c.id == old.run_id)
                     .values(finished_at=func.now() - timedelta(days=40)))
    with engine.begin() as conn:
        assert retention.purge_batch(conn, older_than=timedelta(days=30)) == 1
    assert _read(engine, old.run_id) == []
    assert [e.seq for e in _read(engine, young.run_id)] == [1, 2]
    with engine.connect() as conn:
        head = conn.scalar(select(run_event_heads.c.seq)
                           .where(run_event_heads.c.run_id == old.run_id))
    assert head == 3  # a later event of the purged run is 4, never a number seen before


def test_only_the_schemas_own_triggers_may_run_the_event_writer(engine: Engine) -> None:
    # The writer is SECURITY DEFINER: a role that could attach it to a table of its own would
    # write events (and take numbers) for any run with the migration's rights.
    role = f"events_probe_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role}"))
        try:
            allowed = conn.execute(text(
                "SELECT has_function_privilege(:role, 'outboxkit.record_run_event()', "
                "'EXECUTE')"), {"role": role}).scalar_one()
        finally:
            conn.execute(text(f"DROP ROLE {role}"))
    assert allowed is False
