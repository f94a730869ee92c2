"""A pydantic-ai agent as a durable outboxkit run, on a real PostgreSQL (in one process;
the SIGKILL tests are in tests/e2e/test_agents_crash.py)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from pydantic_ai import Agent, CallDeferred
from pydantic_ai.messages import ModelResponse, ToolCallPart
from pydantic_ai.models.function import FunctionModel
from pydantic_ai.toolsets import FunctionToolset
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio
from outbox.runs.retry import RetryPolicy
from outbox.runs.states import RunState
from outbox.runs.workflows import VersionPolicy
from outbox.settings import OutboxSettings
from outbox_agents import OutboxDurability, effect_message_id
from tests.integration.agents_support import Durable, Script, drive, outbox_rows, support_agent

FAST_RETRY = RetryPolicy(initial_backoff=0.01, max_backoff=0.01, jitter=0)


async def confirm(engine: AsyncEngine, run_id: object, message_id: object,
                  evidence: object) -> None:
    async with engine.begin() as conn:
        assert await aio.apply_confirmation(
            conn, run_id=run_id, confirmation_id=str(message_id), outcome="running",
            evidence=evidence, actor="test")


def test_an_effect_waits_for_its_confirmation_and_the_agent_answers_with_it(
        database_url: str) -> None:
    script = Script()
    durable = support_agent(script)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-1")
            again = await durable.start(conn, "Order A1 is late", key="ticket-1")
        assert again.id == run.id
        first = await durable.work(engine, worker="w1")
        assert first is not None
        assert (first.state, first.model_requests) == (RunState.WAITING, 2)
        rows = await outbox_rows(engine)
        message_id = effect_message_id(run.id, _effect_call_id(await _checkpoint(engine, run.id)))
        assert [(r.message_id, r.topic, r.key, json.loads(r.payload), r.run_id) for r in rows] \
            == [(message_id, "supplier.orders", b"widget", {"item": "widget", "qty": 3}, run.id)]
        # Nothing to do until the confirmation: the run is not runnable.
        assert await durable.work(engine, worker="w1") is None
        await confirm(engine, run.id, message_id, {"reference": "S-77"})
        done = await durable.work(engine, worker="w2")
        assert done is not None
        assert (done.state, done.model_requests) == (RunState.DONE, 1)
        assert done.output == "reordered: {'reference': 'S-77'}"
        async with engine.connect() as conn:
            assert await durable.output(conn, run.id) == done.output
            moves = await aio.history(conn, run.id)
            path = [(t.to_state, t.step) for t in moves]
        # The confirmation moved the run on; the claim after it says so (no lease expired).
        assert moves[4].reason == "confirmed, resumed by w2"
        assert path == [("queued", None), ("running", None), ("waiting", "waiting:reorder"),
                        ("running", "waiting:reorder"), ("running", "waiting:reorder"),
                        ("done", "done")]
        assert len(await outbox_rows(engine)) == 1

    drive(database_url, scenario)
    # Three model requests in all: none was asked twice.
    assert len(script.requests) == 3


def test_a_resumed_run_starts_from_its_last_model_response(database_url: str) -> None:
    lookups: list[str] = []

    def flaky_lookup(order_id: str) -> None:
        lookups.append(order_id)
        if len(lookups) == 1:
            raise TimeoutError("order service timed out")

    script = Script()
    durable = support_agent(script, lookup=flaky_lookup, retry=FAST_RETRY)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-2")
        failed = await durable.work(engine, worker="w1")
        assert failed is not None
        assert (failed.state, failed.model_requests) == (RunState.QUEUED, 1)
        await asyncio.sleep(0.05)
        resumed = await durable.work(engine, worker="w2")
        assert resumed is not None
        # The first model response committed: the resumed worker ran the tool call from it
        # and asked the model only for the next step.
        assert (resumed.state, resumed.model_requests) == (RunState.WAITING, 1)
        assert resumed.run_id == run.id

    drive(database_url, scenario)
    assert len(script.requests) == 2
    assert lookups == ["A1", "A1"]


@pytest.mark.parametrize(("checkpoint_tools_after", "lookups"), [(0.0, 1), (60.0, 2)])
def test_a_tool_round_is_checkpointed_on_its_own_only_when_it_took_long_enough(
        database_url: str, checkpoint_tools_after: float, lookups: int) -> None:
    looked: list[str] = []
    script = Script(fail_at=2)
    durable = support_agent(script, lookup=looked.append, retry=FAST_RETRY,
                            checkpoint_tools_after=checkpoint_tools_after)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-9")
        failed = await durable.work(engine, worker="w1")  # the second model request fails
        assert failed is not None
        assert failed.state is RunState.QUEUED
        async with engine.connect() as conn:
            logged = await aio.read_log(conn, run.id)
        # the response (the lookup call), and, checkpointed on its own, the lookup's result
        assert len(logged) == (2 if lookups == 1 else 1)
        await asyncio.sleep(0.05)
        resumed = await durable.work(engine, worker="w2")
        assert resumed is not None
        assert resumed.state is RunState.WAITING

    drive(database_url, scenario)
    # A tool round checkpointed on its own is not run again; a fast one is (read-only).
    assert looked == ["A1"] * lookups


def test_arguments_that_do_not_validate_are_a_retry_for_the_model_not_a_message(
        database_url: str) -> None:
    script = Script(reorder_args={"item": "widget", "qty": "lots"},
                    fixed_args={"item": "widget", "qty": 2})
    durable = support_agent(script)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-3")
        waiting = await durable.work(engine, worker="w1")
        assert waiting is not None
        assert (waiting.state, waiting.model_requests) == (RunState.WAITING, 3)
        rows = await outbox_rows(engine)
        assert [json.loads(r.payload) for r in rows] == [{"item": "widget", "qty": 2}]
        assert [r.run_id for r in rows] == [run.id]

    drive(database_url, scenario)
    # pydantic-ai told the model what was wrong (the script sends the fixed arguments only
    # after a retry prompt), and the model tried again.
    assert len(script.requests) == 3


def test_an_effect_payload_too_large_is_refused_before_commit(database_url: str) -> None:
    # Within the checkpoint's bound (the model's response is in the history), over the
    # message's: emit refuses it before any statement is sent.
    script = Script(reorder_args={"item": "x" * 5_000, "qty": 1})
    durable = support_agent(script, settings=OutboxSettings(max_message_bytes=2_000))

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-4")
        failed = await durable.work(engine, worker="w1")
        assert failed is not None
        assert failed.state is RunState.FAILED
        assert failed.reason is not None
        assert "InvalidMessage" in failed.reason
        assert "bytes" in failed.reason
        assert await outbox_rows(engine) == []
        async with engine.connect() as conn:
            stored = await aio.get_run(conn, run.id)
        assert stored.state is RunState.FAILED
        assert "max_message_bytes" in (stored.reason or "")
        # The model's response stays recorded: a person sees what the agent asked for.
        assert stored.step == "model-response:2"

    drive(database_url, scenario)


def test_a_message_too_large_for_the_log_fails_the_run_even_after_a_renewal(
        database_url: str) -> None:
    # A lease so short that every save renews it first: the renewal commits, the save is then
    # refused, and the failure must be recorded with the renewed lease (not lost as LeaseLost).
    script = Script()
    durable = support_agent(script, lookup=lambda order_id: None, lease_seconds=0.001,
                            settings=OutboxSettings(max_checkpoint_bytes=300))

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-10")
        failed = await durable.work(engine, worker="w1")
        assert failed is not None
        assert failed.state is RunState.FAILED, failed
        assert "CheckpointTooLarge" in (failed.reason or "")
        async with engine.connect() as conn:
            assert (await aio.get_run(conn, run.id)).state is RunState.FAILED

    drive(database_url, scenario)


def test_an_effect_that_needs_approval_waits_for_the_grant_then_sends(
        database_url: str) -> None:
    script = Script()
    durable = support_agent(script, requires_approval=True)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-5")
        asked = await durable.work(engine, worker="w1")
        assert asked is not None
        assert asked.state is RunState.WAITING
        assert await outbox_rows(engine) == []
        checkpoint = await _checkpoint(engine, run.id)
        [pending] = checkpoint["calls"]
        assert (pending["approval"], pending["sent"]) == (True, False)
        assert pending["args"] == {"item": "widget", "qty": 3}
        # Not granted yet: nothing to do.
        assert await durable.work(engine, worker="w1") is None
        async with engine.begin() as conn:
            await aio.grant(conn, pending["approval_id"], by="alice")
        sent = await durable.work(engine, worker="w2")
        assert sent is not None
        assert (sent.state, sent.model_requests) == (RunState.WAITING, 0)
        [row] = await outbox_rows(engine)
        assert row.message_id == effect_message_id(run.id, pending["call_id"])
        await confirm(engine, run.id, row.message_id, {"reference": "S-1"})
        done = await durable.work(engine, worker="w3")
        assert done is not None
        assert done.state is RunState.DONE

    drive(database_url, scenario)
    assert len(script.requests) == 3


def test_an_approval_that_expired_while_the_run_waited_sends_it_to_a_person(
        database_url: str) -> None:
    durable = support_agent(Script(), requires_approval=True,
                            approval_expires=timedelta(seconds=1))

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="ticket-6")
        asked = await durable.work(engine, worker="w1")
        assert asked is not None
        assert asked.state is RunState.WAITING
        # The run wakes at the approval's expiry and revalidates it.
        await asyncio.sleep(1.3)
        expired = await durable.work(engine, worker="w2")
        assert expired is not None
        assert expired.state is RunState.NEEDS_HUMAN
        assert "expired" in (expired.reason or "")
        assert await outbox_rows(engine) == []
        async with engine.connect() as conn:
            assert (await aio.get_run(conn, run.id)).state is RunState.NEEDS_HUMAN

    drive(database_url, scenario)


def test_a_run_pinned_to_another_agent_version_follows_the_version_policy(
        database_url: str) -> None:
    old = support_agent(Script())
    changed = support_agent(Script(), instructions="Help with orders, politely.")
    tolerant = support_agent(Script(), instructions="Help with orders, politely.",
                             on_version_change=VersionPolicy.CONTINUE)
    assert old.workflow.version != changed.workflow.version
    assert old.workflow.prompt_version != changed.workflow.prompt_version
    assert old.workflow.tool_schema_version == changed.workflow.tool_schema_version

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await old.start(conn, "Order A1 is late", key="ticket-7")
        # needs-review (the default): the new code does not touch the old run.
        assert await changed.work(engine, worker="w1") is None
        async with engine.begin() as conn:
            other = await old.start(conn, "Order B2 is late", key="ticket-8")
        async with engine.connect() as conn:
            reviewed = await aio.get_run(conn, run.id)
        assert reviewed.state is RunState.NEEDS_HUMAN
        assert "prompt_version" in (reviewed.reason or "")
        going = await tolerant.work(engine, worker="w2")
        assert going is not None
        assert (going.run_id, going.state) == (other.id, RunState.WAITING)

    drive(database_url, scenario)


def test_a_deferred_tool_that_is_not_an_effect_fails_the_run_with_a_clear_reason(
        database_url: str) -> None:
    def script(messages: object, info: object) -> ModelResponse:
        return ModelResponse(parts=[ToolCallPart("ask_elsewhere", {})])

    tools = FunctionToolset(id="elsewhere")

    @tools.tool_plain
    def ask_elsewhere() -> str:
        raise CallDeferred

    durable = Durable(Agent(FunctionModel(script), name="deferring", output_type=str,
                            toolsets=[tools], capabilities=[OutboxDurability()]))

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            await durable.start(conn, "go", key="k")
        failed = await durable.work(engine, worker="w1")
        assert failed is not None
        assert failed.state is RunState.FAILED
        assert "ask_elsewhere" in (failed.reason or "")
        assert "Effects.effect" in (failed.reason or "")

    drive(database_url, scenario)


async def _checkpoint(engine: AsyncEngine, run_id: object) -> dict[str, object]:
    async with engine.connect() as conn:
        run = await aio.get_run(conn, run_id)  # type: ignore[arg-type]
    assert isinstance(run.checkpoint, dict)
    return run.checkpoint


def _effect_call_id(checkpoint: dict[str, object]) -> str:
    calls = checkpoint["calls"]
    assert isinstance(calls, list)
    [effect] = calls
    return str(effect["call_id"])
