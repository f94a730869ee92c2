"""Property: whatever sequence of run operations is tried, the database equals the model.

A hypothesis state machine drives real operations (start, claim, transitions to every state,
heartbeats and checkpoints with current, stale and forged fencing tokens, releases, expiries,
operator moves, wake-ups, confirmations, approvals) against the real PostgreSQL, legal and
illegal ones alike. After every step the runs, their history counts, confirmations and
approvals in the database must equal :mod:`run_model`'s prediction. So an illegal operation
raises the documented error *and* changes nothing (not even a history row or the version),
and a stale or forged token never writes.

Each example runs in a SAVEPOINT of one shared transaction and is rolled back at its end.
In one transaction ``now()`` stands still: lease expiry is simulated by moving
``lease_expires_at`` into the past (the "expire" rule), which is what time passing does.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import Connection, Engine, text

from outbox.errors import (
    ApprovalInvalid,
    CheckpointTooLarge,
    ConfigurationError,
    EvidenceRequired,
    IllegalTransition,
    LeaseLost,
    RunNotFound,
)
from outbox.runs.approvals import grant, request_approval, revalidate, revoke
from outbox.runs.checkpoints import KEEP
from outbox.runs.confirm import apply_confirmation
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import (
    claim,
    move,
    release,
    renew,
    save_checkpoint,
    start_run,
    transition,
    wake,
)
from outbox.runs.states import RunState
from outbox.settings import OutboxSettings
from tests.faults.properties.profiles import EXAMPLES, PROFILE
from tests.faults.properties.run_model import (
    RUNNING,
    ApprovalModel,
    RunModel,
    legal,
    observe,
    sources,
)

pytestmark = pytest.mark.timeout(300)

T = TypeVar("T")
SETTINGS = OutboxSettings(max_checkpoint_bytes=256)
STEPS = 6  # operations per example, after the two first runs
KEYS = ["run-a", "run-b", "run-c"]  # run-c is not started until a step starts it
UNKNOWN_RUN = uuid.UUID(int=404)
UNKNOWN_APPROVAL = uuid.UUID(int=405)
# Waiting first: hypothesis favours the first option, and waiting leads furthest (wake-ups,
# confirmations, approvals); every state is tried.
STATES = ["waiting", "done", "failed", "needs-human", "queued", "running"]
RARELY = st.sampled_from([False, False, False, True])  # an id nobody has
TOO_BIG = {"blob": "x" * 300}  # over max_checkpoint_bytes
checkpoints = st.sampled_from([None, {"step": 1}, {"step": 2, "notes": ["a"]}, TOO_BIG])
WAKES = {"none": None, "due": timedelta(0), "later": timedelta(hours=1)}
# Mostly the lease as given (current or stale); sometimes a forged token or version.
TAMPER = st.sampled_from(["as-is", "as-is", "as-is", "token+1", "token-1", "version+1",
                          "version-1"])


def tampered(lease: Lease, how: str) -> Lease:
    """*lease*, or a forgery of it: its token or version one off ("token+1", ...)."""
    if how == "as-is":
        return lease
    name, step = how[:-2], (1 if how.endswith("+1") else -1)
    return replace(lease, **{name: getattr(lease, name) + step})


class RunMachine(RuleBasedStateMachine):
    approvals = Bundle("approvals")

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        self.savepoint = conn.begin_nested()
        self.runs: dict[str, RunModel] = {}
        self.workflow_of: dict[str, str] = {}
        self.approval_models: dict[uuid.UUID, ApprovalModel] = {}
        self.issued: list[Lease] = []  # every lease any write returned: current and stale

    def teardown(self) -> None:
        self.savepoint.rollback()

    # --- helpers -------------------------------------------------------------------------
    def model(self, run_id: uuid.UUID) -> RunModel | None:
        return next((m for m in self.runs.values() if m.id == run_id), None)

    def run_id(self, key: str | None) -> uuid.UUID:
        model = self.runs.get(key) if key else None
        return model.id if model else UNKNOWN_RUN

    def aim(self, data: st.DataObject, states: set[str]) -> str:
        """A run key, usually one whose run is in *states* (where the operation can succeed;
        uniform keys would make most steps refusals), sometimes any key at all."""
        fitting = [k for k, m in self.runs.items() if m.state in states]
        if fitting and data.draw(st.sampled_from([True, True, True, False]), label="aimed"):
            return data.draw(st.sampled_from(fitting), label="key")
        return data.draw(st.sampled_from(KEYS), label="key")

    def lease(self, data: st.DataObject) -> Lease:
        """A lease to write with: usually a run's current one, else any issued (most likely
        stale); then, sometimes, its token or version forged."""
        current = [lease for lease in self.issued if self.fenced(lease, {RUNNING}) is None]
        if current and data.draw(st.sampled_from([True, True, False]), label="current"):
            lease = data.draw(st.sampled_from(current), label="lease")
        else:
            lease = data.draw(st.sampled_from(self.issued), label="lease")
        return tampered(lease, data.draw(TAMPER, label="tamper"))

    def issue(self, lease: Lease) -> Lease:
        self.issued.append(lease)
        return lease

    def fenced(self, lease: Lease, allowed: set[str]) -> type[Exception] | None:
        """The error a fenced write with *lease* must raise, or None when it must succeed."""
        model = self.model(lease.run_id)
        if model is None:
            return RunNotFound
        if (model.token, model.version) != (lease.token, lease.version):
            return LeaseLost
        if model.state not in allowed:
            return IllegalTransition
        return None

    def attempt(self, expected: type[Exception] | None, call: Callable[[], T]) -> T | None:
        """Run *call*; it must raise exactly *expected*, or succeed when that is None."""
        if expected is None:
            return call()
        with pytest.raises(expected):
            call()
        return None

    # --- starting and claiming -----------------------------------------------------------
    @initialize(target=approvals)
    def first_runs(self) -> Any:
        """Every example starts with run-a running (leased by w1, with a granted approval)
        and run-b waiting (its old lease stale, its approval pending), so that its few
        steps reach the interesting cases at once. Put in place with plain INSERTs: the
        steps, not the setup, are what is tested."""
        a, b, granted, pending = (uuid.uuid4() for _ in range(4))
        self.conn.execute(
            text("WITH runs AS (INSERT INTO outboxkit.agent_runs (id, workflow,"
                 "  workflow_version, state, idempotency_key, lease_owner, lease_token,"
                 "  lease_expires_at, version)"
                 " VALUES (:a, 'props', '1', 'running', 'run-a', 'w1', 1,"
                 "         now() + interval '1 hour', 1),"
                 "        (:b, 'props', '1', 'waiting', 'run-b', NULL, 1, NULL, 2))"
                 " INSERT INTO outboxkit.approvals (id, run_id, scope, expires_at, granted_by,"
                 "  granted_at)"
                 " VALUES (:granted, :a, '{\"amount\": [1, 2]}', now() + interval '1 hour',"
                 "         'boss', now()),"
                 "        (:pending, :b, '{\"amount\": [1, 2]}', now() + interval '1 hour',"
                 "         NULL, NULL)"),
            {"a": a, "b": b, "granted": granted, "pending": pending},
        )
        self.approval_models[granted] = ApprovalModel(a, expired=False, granted=True)
        self.approval_models[pending] = ApprovalModel(b, expired=False)
        self.runs["run-a"] = RunModel(a, state=RUNNING, token=1, version=1, owner="w1",
                                      lease="live", history=0)
        self.runs["run-b"] = RunModel(b, state=RunState.WAITING.value, token=1, version=2,
                                      history=0)
        self.workflow_of.update({"run-a": "props", "run-b": "props"})
        expires = datetime.now(UTC) + timedelta(hours=1)
        self.issue(Lease(a, "w1", 1, 1, expires))
        self.issue(Lease(b, "w1", 1, 1, expires))
        return multiple(granted, pending)

    @rule(key=st.sampled_from(KEYS), workflow=st.sampled_from(["props", "props", "other"]))
    def start(self, key: str, workflow: str) -> None:
        known = self.workflow_of.get(key)
        expected = ConfigurationError if known not in (None, workflow) else None

        def call() -> Any:
            return start_run(self.conn, workflow=workflow, workflow_version="1",
                             idempotency_key=key, settings=SETTINGS)

        run = self.attempt(expected, call)
        if run is None:
            return
        if key in self.runs:  # the same key again: the same run, unchanged
            assert run.id == self.runs[key].id
            return
        assert run.state is RunState.QUEUED
        self.runs[key] = RunModel(run.id)
        self.workflow_of[key] = workflow

    @rule(worker=st.sampled_from(["w1", "w2"]))
    def claim_one(self, worker: str) -> None:
        claimable = {m.id for m in self.runs.values() if m.claimable()}
        got = claim(self.conn, worker=worker, lease_seconds=3600, settings=SETTINGS)
        if not claimable:
            assert got is None
            return
        assert got is not None
        assert got.run.id in claimable
        model = self.model(got.run.id)
        assert model is not None
        model.state, model.owner, model.lease, model.not_before = RUNNING, worker, "live", "none"
        model.token += 1
        model.version += 1
        model.history += 1
        assert (got.lease.token, got.lease.version) == (model.token, model.version)
        self.issue(got.lease)

    # --- a worker's writes, with its lease (current, stale or forged) --------------------
    @rule(data=st.data(), to=st.sampled_from(STATES),
          evidence=st.sampled_from([{"receipt": "r-1"}, None]),
          checkpoint=st.one_of(st.just(KEEP), checkpoints), wake=st.sampled_from(sorted(WAKES)))
    def move_leased(self, data: st.DataObject, to: str, evidence: Any, checkpoint: Any,
                    wake: str) -> None:
        lease = self.lease(data)
        expected: type[Exception] | None
        if not legal(RUNNING, to):
            expected = IllegalTransition
        elif to == RunState.DONE and evidence is None:
            expected = EvidenceRequired
        elif checkpoint is TOO_BIG:
            expected = CheckpointTooLarge
        else:
            expected = self.fenced(lease, {RUNNING})
        new = self.attempt(expected, lambda: transition(
            self.conn, lease, to, evidence=evidence, checkpoint=checkpoint,
            wake_at=WAKES[wake], settings=SETTINGS))
        if new is None:
            return
        model = self.model(lease.run_id)
        assert model is not None
        model.leave_running(to)
        model.version += 1
        model.history += 1
        if checkpoint is not KEEP:
            model.checkpoint = checkpoint
        if to == RunState.WAITING:
            model.not_before = wake
        assert new.version == model.version
        self.issue(new)

    @rule(data=st.data(), seconds=st.sampled_from([3600, 3600, 0]))
    def heartbeat(self, data: st.DataObject, seconds: int) -> None:
        lease = self.lease(data)
        expected = ConfigurationError if seconds <= 0 else self.fenced(lease, {RUNNING})
        new = self.attempt(expected, lambda: renew(self.conn, lease, seconds, settings=SETTINGS))
        if new is None:
            return
        model = self.model(lease.run_id)
        assert model is not None
        model.version += 1
        model.lease = "live"
        self.issue(new)

    @rule(data=st.data(), checkpoint=checkpoints)
    def checkpoint(self, data: st.DataObject, checkpoint: Any) -> None:
        lease = self.lease(data)
        expected = CheckpointTooLarge if checkpoint is TOO_BIG else self.fenced(lease, {RUNNING})
        new = self.attempt(expected, lambda: save_checkpoint(
            self.conn, lease, checkpoint, settings=SETTINGS))
        if new is None:
            return
        model = self.model(lease.run_id)
        assert model is not None
        model.version += 1
        model.checkpoint = checkpoint
        self.issue(new)

    @rule(data=st.data())
    def release_lease(self, data: st.DataObject) -> None:
        lease = self.lease(data)
        expected = self.fenced(lease, {RUNNING})
        self.attempt(expected, lambda: release(self.conn, lease, settings=SETTINGS))
        if expected is None:
            model = self.model(lease.run_id)
            assert model is not None
            model.owner, model.lease = None, "expired"
            model.version += 1
            model.history += 1

    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """Time passes for one run: a live lease runs out (nothing else changes)."""
        key = self.aim(data, {RUNNING})
        self.conn.execute(
            text("UPDATE outboxkit.agent_runs SET lease_expires_at = now() - interval '1 second'"
                 " WHERE id = :id AND lease_expires_at > now()"),
            {"id": self.run_id(key)},
        )
        model = self.runs.get(key)
        if model is not None and model.lease == "live":
            model.lease = "expired"

    # --- operators and consumers (no lease) ----------------------------------------------
    @rule(data=st.data(), to=st.sampled_from(STATES),
          evidence=st.sampled_from([{"by": "ops"}, None]), later=st.booleans())
    def operator_move(self, data: st.DataObject, to: str, evidence: Any, later: bool) -> None:
        key = self.aim(data, sources(to) - {RUNNING})
        run_id = self.run_id(key)
        model = self.model(run_id)
        expected: type[Exception] | None = None
        if to == RUNNING:
            expected = IllegalTransition  # only claim() makes a run running
        elif to == RunState.DONE and evidence is None:
            expected = EvidenceRequired
        elif model is None:
            expected = RunNotFound
        elif model.state not in sources(to):
            expected = IllegalTransition
        elif model.state == RUNNING and model.lease == "live":
            expected = IllegalTransition  # the lease holder moves it, or its lease runs out
        not_before = timedelta(hours=1) if later else None
        self.attempt(expected, lambda: move(self.conn, run_id, to, actor="ops", evidence=evidence,
                                            not_before=not_before, settings=SETTINGS))
        if expected is None:
            assert model is not None
            model.leave_running(to)
            model.version += 1
            model.history += 1
            if to == RunState.QUEUED:
                model.not_before = "later" if later else "none"

    @rule(data=st.data())
    def wake_up(self, data: st.DataObject) -> None:
        run_id = self.run_id(self.aim(data, {RunState.WAITING.value}))
        model = self.model(run_id)
        expected: type[Exception] | None = None
        if model is None:
            expected = RunNotFound
        elif model.state != RunState.WAITING:
            expected = IllegalTransition
        self.attempt(expected, lambda: wake(self.conn, run_id, settings=SETTINGS))
        if expected is None:
            assert model is not None
            model.not_before = "due"
            model.version += 1

    @rule(data=st.data(), confirmation=st.sampled_from(["c-1", "c-2"]),
          outcome=st.sampled_from(["done", "running", "failed", "queued"]),
          evidence=st.sampled_from([{"ref": "s-1"}, None, {}]))
    def confirm(self, data: st.DataObject, confirmation: str, outcome: str,
                evidence: Any) -> None:
        run_id = self.run_id(self.aim(data, {RunState.WAITING.value}))
        model = self.model(run_id)
        expected: type[Exception] | None = None
        if outcome not in {"running", "done", "failed"}:
            expected = ConfigurationError
        elif outcome == RunState.DONE and not evidence:
            expected = EvidenceRequired
        elif model is None:
            expected = RunNotFound
        elif confirmation in model.confirmations:
            expected = None  # applied before: False, and nothing changes
        elif model.state != RunState.WAITING:
            expected = IllegalTransition
        applied = self.attempt(expected, lambda: apply_confirmation(
            self.conn, run_id=run_id, confirmation_id=confirmation, outcome=outcome,  # type: ignore[arg-type]
            evidence=evidence, actor="consumer", settings=SETTINGS))
        if expected is not None:
            return
        assert model is not None
        if confirmation in model.confirmations:
            assert applied is False
            return
        assert applied is True
        model.confirmations.add(confirmation)
        model.state, model.not_before = outcome, "none"
        model.version += 1
        model.history += 2 if outcome == RunState.DONE else 1  # done: waiting→running→done

    # --- approvals -------------------------------------------------------------------------
    @rule(target=approvals, key=st.sampled_from(KEYS),
          expired=st.sampled_from([False, False, True]))
    def request(self, key: str, expired: bool) -> Any:
        model = self.runs.get(key)
        if model is None:
            return multiple()
        expires = timedelta(seconds=-1) if expired else timedelta(hours=1)
        approval = request_approval(self.conn, model.id, scope={"amount": [1, 2]},
                                    expires_at=expires, settings=SETTINGS)
        self.approval_models[approval.id] = ApprovalModel(model.id, expired)
        return approval.id

    @rule(approval=approvals, unknown=RARELY)
    def grant_it(self, approval: uuid.UUID, unknown: bool) -> None:
        approval = UNKNOWN_APPROVAL if unknown else approval
        found = self.approval_models.get(approval)
        expected = None
        if found is None or found.revoked or found.expired:
            expected = ApprovalInvalid
        self.attempt(expected, lambda: grant(self.conn, approval, by="boss", settings=SETTINGS))
        if expected is not None or found is None or found.granted:
            return  # granted before: returned as it is, nothing changes
        found.granted = True
        model = self.model(found.run_id)
        if model is not None and model.state == RunState.WAITING:
            model.not_before = "due"  # the waiting run is woken
            model.version += 1

    @rule(approval=approvals, unknown=RARELY)
    def revoke_it(self, approval: uuid.UUID, unknown: bool) -> None:
        approval = UNKNOWN_APPROVAL if unknown else approval
        found = self.approval_models.get(approval)
        expected = ApprovalInvalid if found is None or found.revoked else None
        self.attempt(expected, lambda: revoke(self.conn, approval, by="boss", settings=SETTINGS))
        if found is not None and expected is None:
            found.revoked = True

    @rule(data=st.data(), approval=approvals, unknown=RARELY, covered=st.booleans())
    def revalidate_it(self, data: st.DataObject, approval: uuid.UUID, unknown: bool,
                      covered: bool) -> None:
        lease = self.lease(data)
        approval = UNKNOWN_APPROVAL if unknown else approval
        found = self.approval_models.get(approval)
        if found is not None and found.run_id != lease.run_id:
            found = None  # another run's approval does not exist for this one
        scope = {"amount": 1 if covered else 3}
        if found is not None and found.pending:
            target, wake_state = RunState.WAITING.value, "later"  # back to waiting until expiry
        elif found is not None and found.granted and not found.revoked and not found.expired \
                and covered:
            check = revalidate(self.conn, lease, approval, scope=scope, settings=SETTINGS)
            assert check.valid  # valid: nothing is written at all
            return
        else:
            target, wake_state = RunState.NEEDS_HUMAN.value, None
        expected = self.fenced(lease, {RUNNING})
        check = self.attempt(expected, lambda: revalidate(
            self.conn, lease, approval, scope=scope, settings=SETTINGS))
        if check is None:
            return
        assert not check.valid
        assert check.state == target
        model = self.model(lease.run_id)
        assert model is not None
        model.leave_running(target)
        model.version += 1
        model.history += 1
        if wake_state is not None:
            model.not_before = wake_state
        self.issue(check.lease)

    # --- the property --------------------------------------------------------------------
    @invariant()
    def database_equals_model(self) -> None:
        found = observe(self.conn)
        assert found.runs == {m.id: m.observed() for m in self.runs.values()}
        assert found.confirmations == {
            (m.id, c) for m in self.runs.values() for c in m.confirmations
        }
        assert found.approvals == {
            aid: (a.granted, a.revoked) for aid, a in self.approval_models.items()
        }


@pytest.fixture(scope="module")
def conn(module_engine: Engine) -> Iterator[Connection]:
    with module_engine.connect() as connection:
        outer = connection.begin()
        try:
            yield connection
        finally:
            outer.rollback()


def test_the_database_always_equals_the_model_of_the_state_machine(conn: Connection) -> None:
    run_state_machine_as_test(
        lambda: RunMachine(conn),
        settings=settings(PROFILE, max_examples=EXAMPLES, stateful_step_count=STEPS),
    )
