"""Confirmations: a consumer moves a waiting run on, once per confirmation id, in its txn."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio
from outbox.db.tables import agent_runs, confirmations, run_transitions
from outbox.errors import ConfigurationError, EvidenceRequired, IllegalTransition, RunNotFound
from outbox.runs.confirm import apply_confirmation
from outbox.runs.lifecycle import claim

EVIDENCE = {"order": "o-1", "status": "accepted"}


def waiting_run(engine: Engine, *, version: int = 5) -> uuid.UUID:
    run_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            insert(agent_runs).values(
                id=run_id,
                workflow="wf",
                workflow_version="1",
                state="waiting",
                step="await-supplier",
                idempotency_key=str(run_id),
                lease_token=2,
                version=version,
            )
        )
    return run_id


def snapshot(engine: Engine, run_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        run = conn.execute(select(agent_runs).where(agent_runs.c.id == run_id)).one()._asdict()
        history = conn.execute(
            select(
                run_transitions.c.from_state,
                run_transitions.c.to_state,
                run_transitions.c.actor,
                run_transitions.c.evidence,
            )
            .where(run_transitions.c.run_id == run_id)
            .order_by(run_transitions.c.id)
        ).all()
        confirmed = conn.execute(select(func.count()).select_from(confirmations)).scalar()
    return {"run": run, "history": [tuple(h) for h in history], "confirmations": confirmed}


def confirm(engine: Engine, run_id: uuid.UUID, outcome: Any, **kwargs: Any) -> bool:
    values: dict[str, Any] = {
        "confirmation_id": "msg-1",
        "evidence": EVIDENCE,
        "actor": "billing-consumer",
    }
    values.update(kwargs)
    with engine.begin() as conn:
        return apply_confirmation(conn, run_id=run_id, outcome=outcome, **values)


class TestOutcomes:
    def test_running_moves_waiting_to_running_without_a_lease(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        assert confirm(engine, run_id, "running") is True
        state = snapshot(engine, run_id)
        assert state["run"]["state"] == "running"
        assert state["run"]["version"] == 6
        assert state["run"]["lease_owner"] is None
        assert state["run"]["last_evidence"] == EVIDENCE
        assert state["history"] == [("waiting", "running", "billing-consumer", EVIDENCE)]
        assert state["confirmations"] == 1

    def test_a_worker_claims_the_confirmed_run_at_once(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        confirm(engine, run_id, "running")
        with engine.begin() as conn:
            claimed = claim(conn, worker="w-2", lease_seconds=30)
        assert claimed is not None
        assert claimed.lease.run_id == run_id
        assert claimed.lease.token == 3

    def test_done_goes_through_running_with_two_history_rows(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        assert confirm(engine, run_id, "done") is True
        state = snapshot(engine, run_id)
        assert state["run"]["state"] == "done"
        assert state["run"]["finished_at"] is not None
        assert state["history"] == [
            ("waiting", "running", "billing-consumer", EVIDENCE),
            ("running", "done", "billing-consumer", EVIDENCE),
        ]

    def test_failed_moves_waiting_to_failed(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        assert confirm(engine, run_id, "failed", evidence={"error": "rejected"}) is True
        state = snapshot(engine, run_id)
        assert state["run"]["state"] == "failed"
        assert state["run"]["finished_at"] is not None
        assert [h[:2] for h in state["history"]] == [("waiting", "failed")]

    @pytest.mark.parametrize("outcome", ["done", "failed"])
    def test_a_finishing_confirmation_sets_the_step_to_its_outcome(
        self, engine: Engine, outcome: str
    ) -> None:
        """A run confirmed done no longer shows the step it waited in (``await-supplier``)."""
        run_id = waiting_run(engine)
        assert confirm(engine, run_id, outcome) is True
        state = snapshot(engine, run_id)
        assert (state["run"]["state"], state["run"]["step"]) == (outcome, outcome)
        with engine.connect() as conn:
            steps = conn.execute(select(run_transitions.c.step)
                                 .where(run_transitions.c.run_id == run_id)).scalars().all()
        assert len(steps) == (2 if outcome == "done" else 1)
        assert set(steps) == {outcome}

    def test_resuming_keeps_the_step_the_worker_carries_on_from(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        assert confirm(engine, run_id, "running") is True
        assert snapshot(engine, run_id)["run"]["step"] == "await-supplier"


class TestIdempotence:
    def test_the_same_confirmation_twice_changes_nothing_the_second_time(
        self, engine: Engine
    ) -> None:
        run_id = waiting_run(engine)
        assert confirm(engine, run_id, "running") is True
        before = snapshot(engine, run_id)
        assert confirm(engine, run_id, "running") is False
        assert snapshot(engine, run_id) == before

    def test_an_old_confirmation_redelivered_after_the_run_waits_again_is_ignored(
        self, engine: Engine
    ) -> None:
        run_id = waiting_run(engine)
        confirm(engine, run_id, "running")
        with engine.begin() as conn:  # the worker went on and now waits for something else
            conn.execute(
                update(agent_runs).where(agent_runs.c.id == run_id).values(state="waiting")
            )
        before = snapshot(engine, run_id)
        assert confirm(engine, run_id, "done") is False
        assert snapshot(engine, run_id) == before
        assert confirm(engine, run_id, "done", confirmation_id="msg-2") is True

    def test_concurrent_duplicates_apply_once_without_error(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        results: list[bool] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)

        def consumer() -> None:
            barrier.wait()
            try:
                results.append(confirm(engine, run_id, "done"))
            except BaseException as exc:  # the test fails on any consumer's error
                errors.append(exc)

        threads = [threading.Thread(target=consumer) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert sorted(results) == [False, False, False, True]
        assert len(snapshot(engine, run_id)["history"]) == 2

    def test_rollback_of_the_consumers_transaction_undoes_the_confirmation(
        self, engine: Engine
    ) -> None:
        run_id = waiting_run(engine)
        with engine.connect() as conn:
            apply_confirmation(
                conn,
                run_id=run_id,
                confirmation_id="m",
                outcome="running",
                evidence=None,
                actor="c",
            )
            conn.rollback()
        state = snapshot(engine, run_id)
        assert state["run"]["state"] == "waiting"
        assert state["confirmations"] == 0
        assert confirm(engine, run_id, "running", confirmation_id="m") is True


class TestRefusals:
    def test_done_without_evidence(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        before = snapshot(engine, run_id)
        with pytest.raises(EvidenceRequired):
            confirm(engine, run_id, "done", evidence=None)
        assert snapshot(engine, run_id) == before

    def test_run_that_is_not_waiting(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        with engine.begin() as conn:
            conn.execute(update(agent_runs).where(agent_runs.c.id == run_id).values(state="queued"))
        before = snapshot(engine, run_id)
        with pytest.raises(IllegalTransition):
            confirm(engine, run_id, "running")
        assert snapshot(engine, run_id) == before

    def test_missing_run(self, engine: Engine) -> None:
        with pytest.raises(RunNotFound):
            confirm(engine, uuid.uuid4(), "running")

    def test_unknown_outcome(self, engine: Engine) -> None:
        run_id = waiting_run(engine)
        with pytest.raises(ConfigurationError):
            confirm(engine, run_id, "needs-human")


def test_async_confirmation_applies_once(engine: Engine, async_engine: AsyncEngine) -> None:
    run_id = waiting_run(engine)

    async def scenario() -> list[bool]:
        outcomes = []
        try:
            for _ in range(2):
                async with async_engine.begin() as conn:
                    outcomes.append(
                        await aio.apply_confirmation(
                            conn,
                            run_id=run_id,
                            confirmation_id=uuid.UUID(int=7),
                            outcome="done",
                            evidence=EVIDENCE,
                            actor="c",
                        )
                    )
        finally:
            await async_engine.dispose()
        return outcomes

    assert asyncio.run(scenario()) == [True, False]
    assert snapshot(engine, run_id)["run"]["state"] == "done"
