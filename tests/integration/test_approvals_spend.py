"""Approvals bound to one exact call and spent once, with the effect (real PostgreSQL).

The run spends its approval in the transaction that inserts the effect's outbox message: a
second spend (a retry, a replayed step, a forged call with other arguments) is refused with
the reason, and its transaction rolls back with the message it tried to send.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import App, ClaimedRun, Envelope, aio, call_digest
from outbox.db.execution import run_plan
from outbox.errors import ApprovalInvalid, LeaseSpent
from outbox.handle import claim
from outbox.runs import approvals
from outbox.runs.lifecycle import start_run

ARGS = {"item": "bolt M6", "qty": 3}
DIGEST = call_digest("reorder", ARGS)


def _bound(engine: Engine, key: str = "r-1", *, expires: timedelta = timedelta(hours=1),
           granted: bool = True, digest: str | None = DIGEST) -> approvals.Approval:
    """A run that asked for an approval of ``reorder(ARGS)`` and waits (granted: woken)."""
    with engine.begin() as conn:
        start_run(conn, workflow="support", workflow_version="1", idempotency_key=key)
    with engine.begin() as conn:
        job = claim(conn, worker="w", lease_seconds=60)
        assert job is not None
        approval = approvals.request_approval(
            conn, job.run.id, scope={"tool": "reorder", "args": ARGS}, expires_at=expires,
            reason="tool reorder needs approval", digest=digest)
        job.transition("waiting", step="approval:reorder")
    if granted:
        with engine.begin() as conn:
            approvals.grant(conn, approval.id, by="alice", reason="ticket 812: stock is out")
    return approval


def _claimed(engine: Engine) -> ClaimedRun[Any]:
    with engine.begin() as conn:
        job = claim(conn, worker="w2", lease_seconds=60)
    assert job is not None
    return job


def _envelope(job: ClaimedRun[Any], qty: int = 3) -> Envelope:
    return Envelope(topic="supplier.orders", type="order.place", key="acme",
                    payload={"item": "bolt M6", "qty": qty}, run_id=job.run.id)


def _send(engine: Engine, job: ClaimedRun[Any], approval_id: uuid.UUID,
          digest: str = DIGEST, qty: int = 3) -> uuid.UUID:
    """One attempt of the step: emit the effect and spend the approval, one transaction."""
    with engine.begin() as conn:
        step = job.on(conn)
        message_id = step.emit(_envelope(step, qty))
        step.spend_approval(approval_id, digest=digest, message_id=message_id)
    return message_id


def _messages(engine: Engine) -> list[uuid.UUID]:
    with engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT message_id FROM outboxkit.outbox_messages ORDER BY id")).scalars())


def _row(engine: Engine, approval_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT * FROM outboxkit.approvals WHERE id = :i"),
                            {"i": approval_id}).one()


def _refused(engine: Engine, attempt: Callable[[], object]) -> ApprovalInvalid:
    before = _messages(engine)
    with pytest.raises(ApprovalInvalid) as refused:
        attempt()
    assert _messages(engine) == before  # rolled back with the message it tried to send
    return refused.value


class TestSpendOnce:
    def test_a_granted_approval_is_spent_with_its_effect_and_records_the_message(
            self, engine: Engine) -> None:
        approval = _bound(engine)
        job = _claimed(engine)
        message_id = _send(engine, job, approval.id)
        row = _row(engine, approval.id)
        assert (row.spent_message_id, row.digest) == (message_id, DIGEST)
        assert row.spent_at is not None
        assert (row.granted_by, row.grant_reason) == ("alice", "ticket 812: stock is out")
        assert _messages(engine) == [message_id]

    def test_a_second_spend_a_replayed_step_is_refused_and_sends_nothing(
            self, engine: Engine) -> None:
        """The step committed, its worker died, the step runs again (same lease): refused,
        naming the message the approval was spent on."""
        approval = _bound(engine)
        job = _claimed(engine)
        first = _send(engine, job, approval.id)
        error = _refused(engine, lambda: _send(engine, job, approval.id))
        assert f"already spent on message {first} at " in str(error)
        assert _messages(engine) == [first]

    def test_a_resumed_run_on_another_worker_cannot_spend_it_again(
            self, engine: Engine) -> None:
        approval = _bound(engine)
        job = _claimed(engine)
        first = _send(engine, job, approval.id)
        with engine.begin() as conn:  # the first worker's lease runs out; another claims
            conn.execute(text("UPDATE outboxkit.agent_runs SET lease_expires_at = now() "
                              "- interval '1 second'"))
        other = _claimed(engine)
        assert other.run.id == job.run.id
        error = _refused(engine, lambda: _send(engine, other, approval.id))
        assert "already spent" in error.reason
        assert _messages(engine) == [first]

    def test_other_arguments_than_those_approved_are_refused(self, engine: Engine) -> None:
        approval = _bound(engine)
        job = _claimed(engine)
        forged = call_digest("reorder", {**ARGS, "qty": 300})
        error = _refused(engine, lambda: _send(engine, job, approval.id, forged, qty=300))
        assert error.reason == (f"the arguments differ from those approved (approved digest "
                                f"{DIGEST}, asked {forged})")
        assert _row(engine, approval.id).spent_at is None
        _send(engine, job, approval.id)  # the approved call itself still goes, once

    def test_an_approval_that_expired_after_the_grant_is_not_spent(self, engine: Engine) -> None:
        approval = _bound(engine)
        job = _claimed(engine)
        with engine.begin() as conn:
            conn.execute(text("UPDATE outboxkit.approvals SET expires_at = now() - "
                              "interval '1 second'"))
        error = _refused(engine, lambda: _send(engine, job, approval.id))
        assert error.reason.startswith("it expired at ")

    def test_a_revoked_approval_is_not_spent(self, engine: Engine) -> None:
        approval = _bound(engine)
        job = _claimed(engine)
        with engine.begin() as conn:
            approvals.revoke(conn, approval.id, by="bob", reason="supplier on hold")
        error = _refused(engine, lambda: _send(engine, job, approval.id))
        assert error.reason == "it was revoked by bob: supplier on hold"

    def test_an_approval_not_granted_yet_is_not_spent(self, engine: Engine) -> None:
        approval = _bound(engine, granted=False)
        error = _refused(engine, lambda: _spend_unleased(engine, approval.id, DIGEST))
        assert error.reason == "it is not granted yet"
        assert "wait for a person to grant it" in str(error)

    def test_a_loose_scope_approval_cannot_be_spent(self, engine: Engine) -> None:
        approval = _bound(engine, digest=None)
        job = _claimed(engine)
        error = _refused(engine, lambda: _send(engine, job, approval.id))
        assert "loose scope" in error.reason
        assert "cannot be spent" in error.reason

    def test_another_runs_approval_is_not_spent(self, engine: Engine) -> None:
        mine = _bound(engine, "mine")
        _claimed(engine)  # mine's run, held: the next claim takes the other run
        theirs = _bound(engine, "theirs")
        job = _claimed(engine)
        assert job.run.id == theirs.run_id
        error = _refused(engine, lambda: _send(engine, job, mine.id))
        assert error.reason == f"it was requested by run {mine.run_id}, not by run {job.run.id}"

    def test_an_unknown_approval_is_refused(self, engine: Engine) -> None:
        _bound(engine)
        job = _claimed(engine)
        missing = uuid.uuid4()
        error = _refused(engine, lambda: _send(engine, job, missing))
        assert (error.approval_id, error.reason) == (missing, "there is no such approval")

    def test_a_handle_whose_lease_ended_spends_nothing(self, engine: Engine) -> None:
        approval = _bound(engine)
        job = _claimed(engine)
        with engine.begin() as conn:
            step = job.on(conn)
            step.release()
            with pytest.raises(LeaseSpent):
                step.spend_approval(approval.id, digest=DIGEST, message_id=uuid.uuid4())
        assert _row(engine, approval.id).spent_at is None

    def test_two_workers_spending_at_once_spend_it_once(self, engine: Engine) -> None:
        """Two transactions race to spend one approval: one sends, the other is told why."""
        for round_ in range(10):
            approval = _bound(engine, f"race-{round_}")
            def spending(pause: Callable[[], None], approval_id: uuid.UUID = approval.id,
                         ) -> approvals.Approval:
                return _spend_unleased(engine, approval_id, DIGEST, pause)

            outcomes = _race(spending, spending, hold_first=round_ % 2 == 0)
            spent = [o for o in outcomes if isinstance(o, approvals.Approval)]
            refused = [o for o in outcomes if isinstance(o, ApprovalInvalid)]
            assert (len(spent), len(refused)) == (1, 1), outcomes
            assert f"already spent on message {spent[0].spent_message_id}" in refused[0].reason


Act = Callable[[Callable[[], None]], Any]


def _spend_unleased(engine: Engine, approval_id: uuid.UUID, digest: str,
                    pause: Callable[[], None] = lambda: None) -> approvals.Approval:
    with engine.begin() as conn:
        spent = run_plan(conn, approvals.spend_plan(approval_id, digest=digest,
                                                    message_id=uuid.uuid4()))
        pause()
        return spent


def _race(first: Act, second: Act, *, hold_first: bool) -> list[Any]:
    """Run *first* and *second* on two threads, each in its own connection and transaction;
    the outcome of each (its result or its ApprovalInvalid).

    Each act calls ``pause()`` after its statement, before its commit. *hold_first*: the
    second starts once the first's statement is done and waits on the row lock until the
    first commits (it must re-check its conditions on the row the first wrote); otherwise
    both start together and the database picks the order."""
    outcomes: list[Any] = [None, None]
    start, holding = threading.Barrier(2), threading.Event()
    waited: list[float] = []

    def hold() -> None:
        holding.set()
        time.sleep(0.1)

    def run(index: int, act: Act) -> None:
        start.wait()
        if hold_first and index == 1:
            assert holding.wait(10)
        began = time.monotonic()
        try:
            outcomes[index] = act(hold if hold_first and index == 0 else lambda: None)
        except ApprovalInvalid as exc:
            outcomes[index] = exc
        if index == 1:
            waited.append(time.monotonic() - began)

    threads = [threading.Thread(target=run, args=(i, act)) for i, act in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if hold_first:  # it really waited for the first's commit
        assert waited[0] >= 0.05, waited
    return outcomes


class TestGrantAndRevoke:
    def test_a_grant_of_other_arguments_than_the_run_asks_for_is_refused(
            self, engine: Engine) -> None:
        """The page showed qty 30; the run asks for qty 3: nothing is granted."""
        approval = _bound(engine, granted=False)
        shown = call_digest("reorder", {**ARGS, "qty": 30})
        with engine.begin() as conn, pytest.raises(ApprovalInvalid) as refused:
            approvals.grant(conn, approval.id, by="alice", digest=shown)
        assert refused.value.reason.startswith(
            "the arguments shown to the person are not those the run asks for")
        assert DIGEST in refused.value.reason
        assert _row(engine, approval.id).granted_at is None
        with engine.begin() as conn:
            granted = approvals.grant(conn, approval.id, by="alice", digest=DIGEST,
                                      reason="checked the stock")
        assert (granted.granted_by, granted.grant_reason) == ("alice", "checked the stock")

    def test_a_grant_after_the_expiry_is_refused(self, engine: Engine) -> None:
        approval = _bound(engine, expires=timedelta(seconds=-1), granted=False)
        with engine.begin() as conn, pytest.raises(ApprovalInvalid, match="expired at"):
            approvals.grant(conn, approval.id, by="alice", digest=DIGEST)
        assert _row(engine, approval.id).granted_at is None

    def test_a_spent_approval_cannot_be_revoked(self, engine: Engine) -> None:
        approval = _bound(engine)
        message_id = _send(engine, _claimed(engine), approval.id)
        with engine.begin() as conn, pytest.raises(ApprovalInvalid) as refused:
            approvals.revoke(conn, approval.id, by="bob", reason="too late")
        assert f"already spent on message {message_id} at " in refused.value.reason
        assert refused.value.reason.endswith(": the effect was sent")
        row = _row(engine, approval.id)
        assert (row.revoked_at, row.revoked_by, row.reason) == (
            None, None, "tool reorder needs approval")

    def test_a_granted_approval_not_spent_yet_is_revoked_as_before(self, engine: Engine) -> None:
        approval = _bound(engine)
        with engine.begin() as conn:
            revoked = approvals.revoke(conn, approval.id, by="bob", reason="changed my mind")
        assert (revoked.granted_by, revoked.revoked_by) == ("alice", "bob")

    def test_a_grant_and_a_revoke_racing_end_in_one_clear_state(self, engine: Engine) -> None:
        """Grant and revoke on two connections at once, many times, each order held both
        ways: the approval ends granted-then-revoked (the grant said granted, the revoke saw
        it granted) or revoked and never granted (the grant was told it was revoked)."""
        seen = set()
        for round_ in range(24):
            approval = _bound(engine, f"gr-{round_}", granted=False)

            def granting(pause: Callable[[], None],
                         approval_id: uuid.UUID = approval.id) -> approvals.Approval:
                with engine.begin() as conn:
                    granted = approvals.grant(conn, approval_id, by="alice", digest=DIGEST)
                    pause()
                    return granted

            def revoking(pause: Callable[[], None],
                         approval_id: uuid.UUID = approval.id) -> approvals.Approval:
                with engine.begin() as conn:
                    revoked = approvals.revoke(conn, approval_id, by="bob", reason="no")
                    pause()
                    return revoked

            pair = (granting, revoking) if round_ % 3 != 1 else (revoking, granting)
            outcomes = _race(*pair, hold_first=round_ % 3 != 2)
            grant_said, revoke_said = outcomes if pair[0] is granting else outcomes[::-1]
            row = _row(engine, approval.id)
            assert isinstance(revoke_said, approvals.Approval), revoke_said
            assert (row.revoked_by, revoke_said.revoked_by) == ("bob", "bob")
            if isinstance(grant_said, approvals.Approval):
                assert grant_said.revoked_at is None  # it granted a live approval
                assert (row.granted_by, revoke_said.granted_by) == ("alice", "alice")
                seen.add("granted-then-revoked")
            else:
                assert isinstance(grant_said, ApprovalInvalid), grant_said
                assert grant_said.reason == "it was revoked by bob"
                assert (row.granted_at, revoke_said.granted_at) == (None, None)
                seen.add("revoked-never-granted")
        assert seen == {"granted-then-revoked", "revoked-never-granted"}


class TestAudit:
    def test_the_audit_lists_who_approved_which_call_and_the_message_it_went_out_as(
            self, engine: Engine) -> None:
        spent = _bound(engine, "a-1")
        message_id = _send(engine, _claimed(engine), spent.id)
        pending = _bound(engine, "a-2", granted=False)
        loose = _bound(engine, "a-3", digest=None)
        with engine.connect() as conn:
            audit = approvals.approvals_audit(conn)
        assert [a.approval_id for a in audit] == [pending.id, spent.id]  # newest first
        assert loose.id not in {a.approval_id for a in audit}
        entry = audit[1]
        assert (entry.run_id, entry.tool, entry.args, entry.digest) == (
            spent.run_id, "reorder", ARGS, DIGEST)
        assert (entry.granted_by, entry.grant_reason) == ("alice", "ticket 812: stock is out")
        assert (entry.spent_message_id, entry.topic, entry.key) == (
            message_id, "supplier.orders", "acme")
        assert entry.granted_at is not None
        assert entry.spent_at is not None
        assert (audit[0].granted_by, audit[0].spent_at, audit[0].topic) == (None, None, None)
        with engine.connect() as conn:
            assert [a.approval_id for a in approvals.approvals_audit(
                conn, run_id=spent.run_id)] == [spent.id]
            assert len(approvals.approvals_audit(conn, limit=1)) == 1

    def test_a_message_the_relay_dropped_still_leaves_who_approved_it(
            self, engine: Engine) -> None:
        approval = _bound(engine)
        message_id = _send(engine, _claimed(engine), approval.id)
        with engine.begin() as conn:  # as the relay's retention does, long after publishing
            conn.execute(text("DELETE FROM outboxkit.outbox_messages"))
        with engine.connect() as conn:
            [entry] = approvals.approvals_audit(conn)
        assert (entry.spent_message_id, entry.topic, entry.key) == (message_id, None, None)
        assert entry.granted_by == "alice"


def test_the_async_handle_spends_once_and_the_app_audits_it(
        engine: Engine, async_engine: AsyncEngine) -> None:
    approval = _bound(engine)
    app = App()

    async def scenario() -> tuple[uuid.UUID, ApprovalInvalid, list[approvals.ApprovalAudit]]:
        try:
            return await steps()
        finally:  # in this loop: its connections must not outlive it
            await async_engine.dispose()

    async def steps() -> tuple[uuid.UUID, ApprovalInvalid, list[approvals.ApprovalAudit]]:
        async with async_engine.begin() as conn:
            job = await aio.claim(conn, worker="w2", lease_seconds=60)
            assert job is not None
            message_id = await job.emit(Envelope(topic="supplier.orders", type="order.place",
                                                 key="acme", payload=ARGS))
            spent = await job.spend_approval(approval.id, digest=DIGEST, message_id=message_id)
            assert spent.spent_message_id == message_id
        with pytest.raises(ApprovalInvalid) as again:
            async with async_engine.begin() as conn:
                await job.on(conn).spend_approval(approval.id, digest=DIGEST,
                                                  message_id=uuid.uuid4())
        async with async_engine.connect() as conn:
            audit = await app.approvals_audit_async(conn, run_id=approval.run_id)
        return message_id, again.value, audit

    message_id, refused, audit = asyncio.run(scenario())
    assert f"already spent on message {message_id}" in refused.reason
    assert [(a.approval_id, a.spent_message_id) for a in audit] == [(approval.id, message_id)]
    with engine.connect() as conn:
        assert [a.approval_id for a in App().approvals_audit(conn)] == [approval.id]
