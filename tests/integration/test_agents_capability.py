"""The OutboxDurability capability on a real PostgreSQL: its persisted unit names, effects of
one response sent together, deps and usage limits across turns, approvals spent once."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic_ai import Agent, DeferredToolRequests, RunContext
from pydantic_ai.capabilities import RetryOnModelErrors
from pydantic_ai.exceptions import ModelServerError, UsageLimitExceeded
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import UsageLimits
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

import outbox_agents
from outbox import App, aio
from outbox.errors import ConfigurationError
from outbox.runs.retry import RetryPolicy
from outbox.runs.states import RunState
from outbox_agents import Effects, OutboxDurability, effect_message_id
from tests.integration.agents_support import (
    Durable,
    Reorder,
    Script,
    drive,
    outbox_rows,
    support_agent,
)

NO_RETRY = RetryPolicy(max_attempts=1)


def pinned_script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """lookup, then reorder, then the answer; fixed tool call ids."""
    last = messages[-1].parts[-1]
    if isinstance(last, ToolReturnPart) and last.tool_name == "reorder":
        return ModelResponse(parts=[TextPart("done")])
    if isinstance(last, ToolReturnPart):
        return ModelResponse(parts=[ToolCallPart("reorder", {"item": "widget", "qty": 3},
                                                 tool_call_id="call-2")])
    return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "A1"},
                                             tool_call_id="call-1")])


def test_the_journals_persisted_unit_names_are_pinned(database_url: str) -> None:
    # These names are compatibility data: a run journaled under them must replay after an
    # upgrade. Never update this list as part of a rename (see pydantic-ai's durable_exec
    # guidelines): a change strands every run under way.
    effects = Effects()

    @effects.effect(topic="supplier.orders", key=lambda order: order.item)
    def reorder(item: str, qty: int) -> Reorder:
        """Order more."""
        return Reorder(item=item, qty=qty)

    agent = Agent(FunctionModel(pinned_script), name="pinned", output_type=str,
                  toolsets=[effects], capabilities=[OutboxDurability()])

    @agent.tool_plain
    def lookup_order(order_id: str) -> dict[str, str]:
        """Look an order up."""
        return {"item": "widget"}

    durable = Durable(agent)

    async def scenario(engine: AsyncEngine) -> list[str]:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="pin")
        assert (await durable.work(engine, worker="w")).state is RunState.WAITING  # type: ignore[union-attr]
        [row] = await outbox_rows(engine)
        async with engine.begin() as conn:
            await aio.apply_confirmation(conn, run_id=run.id, confirmation_id=str(row.message_id),
                                         outcome="running", evidence={"ref": 1}, actor="t")
        assert (await durable.work(engine, worker="w")).state is RunState.DONE  # type: ignore[union-attr]
        async with engine.connect() as conn:
            return [entry["op"] for entry in await aio.read_log(conn, run.id)]

    assert drive(database_url, scenario) == [
        "pinned__model.request",
        "pinned__function_toolset__<agent>.call_tool:lookup_order@call-1",
        "pinned__model.request#1",
        "pinned__function_toolset__outboxkit-effects.call_tool:reorder@call-2",
        "pinned__model.request#2",
    ]


def test_effects_of_one_response_go_out_together_and_one_key_waits_for_its_first(
        database_url: str) -> None:
    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1].parts[-1]
        if isinstance(last, ToolReturnPart):
            return ModelResponse(parts=[TextPart("all ordered")])
        return ModelResponse(parts=[
            ToolCallPart("reorder", {"item": "widget", "qty": 1}, tool_call_id="a"),
            ToolCallPart("reorder", {"item": "gadget", "qty": 2}, tool_call_id="b"),
            ToolCallPart("reorder", {"item": "widget", "qty": 5}, tool_call_id="c"),
        ])

    effects = Effects()

    @effects.effect(topic="supplier.orders", key=lambda order: order.item)
    def reorder(item: str, qty: int) -> Reorder:
        """Order more."""
        return Reorder(item=item, qty=qty)

    durable = Durable(Agent(FunctionModel(script), name="many", output_type=str,
                            toolsets=[effects], capabilities=[OutboxDurability()]))

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "restock", key="many")
        first = await durable.work(engine, worker="w")
        assert first is not None
        assert first.state is RunState.WAITING
        # widget and gadget together, in one transaction; the second widget waits for the
        # first's confirmation (one key, one message in flight).
        ids = {call: effect_message_id(run.id, call) for call in "abc"}
        rows = await outbox_rows(engine)
        assert [(r.message_id, r.key) for r in rows] == [(ids["a"], b"widget"),
                                                         (ids["b"], b"gadget")]
        await _confirm(engine, run.id, ids["b"], {"ref": "B"})
        assert await durable.work(engine, worker="w") is not None  # woken: still waiting on a
        assert len(await outbox_rows(engine)) == 2
        await _confirm(engine, run.id, ids["a"], {"ref": "A"})
        second = await durable.work(engine, worker="w")
        assert second is not None
        assert second.state is RunState.WAITING
        rows = await outbox_rows(engine)
        assert [r.message_id for r in rows] == [ids["a"], ids["b"], ids["c"]]
        assert json.loads(rows[2].payload) == {"item": "widget", "qty": 5}
        await _confirm(engine, run.id, ids["c"], {"ref": "C"})
        done = await durable.work(engine, worker="w")
        assert done is not None
        assert (done.state, done.output, done.model_requests) == (RunState.DONE, "all ordered", 1)

    drive(database_url, scenario)


@dataclass
class Shop:
    name: str
    discount: int


def test_deps_given_at_start_survive_a_resume(database_url: str) -> None:
    seen: list[Any] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1].parts[-1]
        if isinstance(last, ToolReturnPart) and last.tool_name == "shop_name":
            return ModelResponse(parts=[TextPart(f"ok from {last.content}")])
        if isinstance(last, ToolReturnPart):
            return ModelResponse(parts=[ToolCallPart("shop_name", {})])
        return ModelResponse(parts=[ToolCallPart("reorder", {"item": "w", "qty": 1})])

    effects = Effects()

    @effects.effect(topic="supplier.orders")
    def reorder(item: str, qty: int) -> Reorder:
        """Order more."""
        return Reorder(item=item, qty=qty)

    agent = Agent(FunctionModel(script), name="deps", output_type=str, deps_type=Shop,
                  toolsets=[effects], capabilities=[OutboxDurability()])

    @agent.tool
    def shop_name(ctx: RunContext[Shop]) -> str:
        """The shop's name."""
        seen.append(ctx.deps)
        return ctx.deps.name

    durable = Durable(agent)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "go", key="deps", deps=Shop("corner", 10))
        waiting = await durable.work(engine, worker="w1")
        assert waiting is not None
        assert waiting.state is RunState.WAITING
        [row] = await outbox_rows(engine)
        await _confirm(engine, run.id, row.message_id, {"ref": 1})
        assert seen == []
        # Another worker, given no deps: the tool that runs after the confirmation gets the
        # run's own.
        done = await durable.work(engine, worker="w2")
        assert done is not None
        assert (done.state, done.output) == (RunState.DONE, "ok from corner")

    drive(database_url, scenario)
    assert seen == [Shop("corner", 10)]


def test_deps_that_are_not_data_are_refused_at_start_naming_the_way_out(
        database_url: str) -> None:
    agent = Agent(FunctionModel(pinned_script), name="deps-bad", deps_type=object,
                  capabilities=[OutboxDurability()])

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            with pytest.raises(ConfigurationError, match="rebuild_deps"):
                await Durable(agent).start(conn, "go", key="k", deps=object())

    drive(database_url, scenario)


def test_usage_limits_count_the_whole_run_not_one_turn(database_url: str) -> None:
    durable = support_agent(Script(), usage_limits=UsageLimits(request_limit=2),
                            retry=NO_RETRY)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key="limits")
        waiting = await durable.work(engine, worker="w1")  # two requests: lookup, reorder
        assert waiting is not None
        assert waiting.state is RunState.WAITING
        [row] = await outbox_rows(engine)
        await _confirm(engine, run.id, row.message_id, {"ref": 1})
        # The answer would be the run's third request: over the limit, though this turn
        # makes its first.
        over = await durable.work(engine, worker="w2")
        assert over is not None
        assert over.state is RunState.FAILED
        assert UsageLimitExceeded.__name__ in (over.reason or "")
        assert over.model_requests == 0

    drive(database_url, scenario)


@pytest.mark.parametrize("tamper", ["replayed", "other-arguments", "other-digest"])
def test_an_approval_is_spent_once_and_only_on_the_arguments_granted(
        database_url: str, tamper: str) -> None:
    durable = support_agent(Script(), requires_approval=True)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "Order A1 is late", key=f"spend-{tamper}")
        await durable.work(engine, worker="w1")
        checkpoint = await _checkpoint(engine, run.id)
        [call] = checkpoint["calls"]
        async with engine.begin() as conn:
            await aio.grant(conn, call["approval_id"], by="alice", reason="usual supplier")
        if tamper != "replayed":
            # A forged call under the approval granted for these arguments: other arguments
            # (refused by the approval's scope), or the same ones with another digest
            # (refused when the approval is spent).
            if tamper == "other-arguments":
                call["args"] = {"item": "widget", "qty": 300}
            call["digest"] = "sha256:" + "0" * 64
            await _set_checkpoint(engine, run.id, checkpoint)
            refused = await durable.work(engine, worker="w2")
            assert refused is not None
            assert refused.state is RunState.NEEDS_HUMAN
            expected = "out of scope" if tamper == "other-arguments" else "differ"
            assert expected in (refused.reason or ""), refused.reason
            assert await outbox_rows(engine) == []
            return
        sent = await durable.work(engine, worker="w2")
        assert sent is not None
        assert sent.state is RunState.WAITING
        assert len(await outbox_rows(engine)) == 1
        # A replayed history: the checkpoint from before the send, as a stale copy would
        # have it. The approval is spent: nothing goes out a second time.
        await _set_checkpoint(engine, run.id, {**checkpoint, "calls": [
            {**call, "approval_id": call["approval_id"], "sent": False}]})
        async with engine.begin() as conn:
            await conn.execute(text(
                "UPDATE outboxkit.agent_runs SET not_before = now() WHERE id = :r"),
                {"r": run.id})
        replayed = await durable.work(engine, worker="w3")
        assert replayed is not None
        assert replayed.state is RunState.NEEDS_HUMAN
        assert "already spent" in (replayed.reason or ""), replayed.reason
        assert len(await outbox_rows(engine)) == 1

    drive(database_url, scenario)


def test_an_agent_without_the_capability_is_refused_by_the_worker(database_url: str) -> None:
    app = App(database_url=database_url)
    with pytest.raises(ConfigurationError, match="OutboxDurability"):
        app.register_agent(Agent(FunctionModel(pinned_script), name="plain"))


async def _confirm(engine: AsyncEngine, run_id: Any, message_id: Any, evidence: Any) -> None:
    async with engine.begin() as conn:
        assert await aio.apply_confirmation(
            conn, run_id=run_id, confirmation_id=str(message_id), outcome="running",
            evidence=evidence, actor="test")


async def _checkpoint(engine: AsyncEngine, run_id: Any) -> dict[str, Any]:
    async with engine.connect() as conn:
        run = await aio.get_run(conn, run_id)
    assert isinstance(run.checkpoint, dict)
    return run.checkpoint


async def _set_checkpoint(engine: AsyncEngine, run_id: Any, checkpoint: Any) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(
            "UPDATE outboxkit.agent_runs SET checkpoint = CAST(:c AS jsonb) WHERE id = :r"),
            {"c": json.dumps(checkpoint), "r": run_id})




def test_a_run_goes_on_from_its_message_history_with_one_run_id_across_turns(
        database_url: str) -> None:
    seen_run_ids: list[str | None] = []
    told: list[list[str]] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        told.append([type(m).__name__ for m in messages])
        last = messages[-1].parts[-1]
        if isinstance(last, ToolReturnPart) and last.tool_name == "reorder":
            return ModelResponse(parts=[ToolCallPart("whoami", {})])
        if isinstance(last, ToolReturnPart):
            return ModelResponse(parts=[TextPart("ok")])
        return ModelResponse(parts=[ToolCallPart("reorder", {"item": "w", "qty": 1})])

    effects = Effects()

    @effects.effect(topic="supplier.orders")
    def reorder(item: str, qty: int) -> Reorder:
        """Order more."""
        return Reorder(item=item, qty=qty)

    agent = Agent(FunctionModel(script), name="history", output_type=str,
                  toolsets=[effects], capabilities=[OutboxDurability()])

    @agent.tool
    def whoami(ctx: RunContext[None]) -> str:
        """The run's id."""
        seen_run_ids.append(ctx.run_id)
        return "me"

    earlier = [ModelRequest.user_text_prompt("my shop is the corner one"),
               ModelResponse(parts=[TextPart("noted")])]
    durable = Durable(agent)

    async def scenario(engine: AsyncEngine) -> Any:
        async with engine.begin() as conn:
            run = await outbox_agents.start(conn, agent, "restock", key="h",
                                            message_history=earlier)
        await durable.work(engine, worker="w1")
        [row] = await outbox_rows(engine)
        await _confirm(engine, run.id, row.message_id, {"ref": 1})
        done = await durable.work(engine, worker="w2")
        assert done is not None
        assert done.state is RunState.DONE
        return run.id

    run_id = drive(database_url, scenario)
    # The model saw the earlier conversation first, in both turns' requests.
    assert all(names[:2] == ["ModelRequest", "ModelResponse"] for names in told)
    assert len(told[0]) == 3
    # pydantic-ai's run id is the run's, whichever worker drives it.
    assert seen_run_ids == [str(run_id)]


def test_a_model_request_retried_inside_the_turn_is_journaled_under_the_first_key(
        database_url: str) -> None:
    # pydantic-ai's own retry (RetryOnModelErrors) makes a failed request again inside the
    # unit's caller: the failure takes no key, so the next turn replays the retry's response
    # and does not ask the model again.
    calls: list[int] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls.append(len(messages))
        if len(calls) == 1:
            raise ModelServerError("m", "overloaded")
        last = messages[-1].parts[-1]
        if isinstance(last, ToolReturnPart) and last.tool_name == "reorder":
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("reorder", {"item": "w", "qty": 1},
                                                 tool_call_id="c1")])

    effects = Effects()

    @effects.effect(topic="supplier.orders")
    def reorder(item: str, qty: int) -> Reorder:
        """Order more."""
        return Reorder(item=item, qty=qty)

    durable = Durable(Agent(
        FunctionModel(script), name="retried", output_type=str, toolsets=[effects],
        capabilities=[RetryOnModelErrors(initial_delay=0.01, max_delay=0.01),
                      OutboxDurability()]))

    async def scenario(engine: AsyncEngine) -> list[str]:
        async with engine.begin() as conn:
            run = await durable.start(conn, "go", key="retried")
        waiting = await durable.work(engine, worker="w1")
        assert waiting is not None
        assert waiting.state is RunState.WAITING
        [row] = await outbox_rows(engine)
        await _confirm(engine, run.id, row.message_id, {"ref": 1})
        done = await durable.work(engine, worker="w2")
        assert done is not None
        assert (done.state, done.model_requests) == (RunState.DONE, 1)
        async with engine.connect() as conn:
            return [entry["op"] for entry in await aio.read_log(conn, run.id)]

    ops = drive(database_url, scenario)
    assert ops[0] == "retried__model.request"
    assert len(calls) == 3  # the failure, its retry, the answer: none asked twice


def test_a_tool_call_id_the_model_uses_again_is_another_effect(database_url: str) -> None:
    # pydantic-ai's TestModel, and some providers, number tool calls per response: the
    # second reorder has the first one's id, and must be its own message.
    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = [p for m in messages for p in m.parts
                if isinstance(p, ToolReturnPart) and p.tool_name == "reorder"]
        if len(done) == 2:
            return ModelResponse(parts=[TextPart(f"{done[0].content} {done[1].content}")])
        item = "first" if not done else "second"
        return ModelResponse(parts=[ToolCallPart("reorder", {"item": item, "qty": 1},
                                                 tool_call_id="call_0")])

    effects = Effects()

    @effects.effect(topic="supplier.orders", key=lambda order: order.item)
    def reorder(item: str, qty: int) -> Reorder:
        """Order more."""
        return Reorder(item=item, qty=qty)

    durable = Durable(Agent(FunctionModel(script), name="same-id", output_type=str,
                            toolsets=[effects], capabilities=[OutboxDurability()]))

    async def scenario(engine: AsyncEngine) -> Any:
        async with engine.begin() as conn:
            run = await durable.start(conn, "go", key="same-id")
        for expected in (1, 2):
            waiting = await durable.work(engine, worker="w")
            assert waiting is not None
            assert waiting.state is RunState.WAITING
            rows = await outbox_rows(engine)
            assert len(rows) == expected
            await _confirm(engine, run.id, rows[-1].message_id,
                           {"ref": json.loads(rows[-1].payload)["item"]})
        done = await durable.work(engine, worker="w")
        assert done is not None
        return done.output, [json.loads(r.payload)["item"] for r in await outbox_rows(engine)]

    output, items = drive(database_url, scenario)
    assert items == ["first", "second"]
    assert output == "{'ref': 'first'} {'ref': 'second'}"


def test_an_agent_with_output_validators_lists_the_deferred_output_itself(
        database_url: str) -> None:
    effects = Effects()

    @effects.effect(topic="supplier.orders")
    def reorder(item: str, qty: int) -> Reorder:
        """Order more."""
        return Reorder(item=item, qty=qty)

    def validated(output_type: Any) -> Agent[Any, Any]:
        agent = Agent(FunctionModel(pinned_script), name="validated", toolsets=[effects],
                      output_type=output_type, capabilities=[OutboxDurability()])

        @agent.output_validator
        def shout(value: Any) -> Any:
            return value.upper() if isinstance(value, str) else value

        @agent.tool_plain
        def lookup_order(order_id: str) -> dict[str, str]:
            """Look an order up."""
            return {"item": "widget"}

        return agent

    # pydantic-ai refuses another output type for its runs: said at registration.
    with pytest.raises(ConfigurationError, match="DeferredToolRequests"):
        App(database_url=database_url).register_agent(validated(str))
    durable = Durable(validated([str, DeferredToolRequests]))

    async def scenario(engine: AsyncEngine) -> Any:
        async with engine.begin() as conn:
            run = await durable.start(conn, "go", key="validated")
        waiting = await durable.work(engine, worker="w")
        assert waiting is not None
        assert waiting.state is RunState.WAITING
        [row] = await outbox_rows(engine)
        await _confirm(engine, run.id, row.message_id, {"ref": 1})
        done = await durable.work(engine, worker="w")
        assert done is not None
        return done.output

    assert drive(database_url, scenario) == "DONE"


def test_a_slow_model_call_keeps_the_lease_alive(database_url: str) -> None:
    # A model call longer than the lease: the heartbeat renews it, so no other worker can
    # take the run over and ask the model again. A lease of 1.5 s, renewed every 0.5 s,
    # is lost only if a renewal is a second late: with 0.6 s (every 0.2 s), one 0.4 s
    # late under CI's load let the thief in (2026-12-06).
    script = Script()
    durable = support_agent(script, lease_seconds=1.5)

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            await durable.start(conn, "Order A1 is late", key="slow")
        hold = asyncio.Event()
        script.hold = hold
        first = asyncio.create_task(durable.work(engine, worker="slow"))
        await asyncio.sleep(2.5)  # past the lease: without renewals it has expired
        # A thief that claimed the run would block in the held model call: bounded.
        assert await asyncio.wait_for(durable.work(engine, worker="thief"), 5) is None
        hold.set()
        progress = await first
        assert progress is not None
        assert progress.state is RunState.WAITING

    drive(database_url, scenario)
    assert len(script.requests) == 2


def test_an_effect_waiting_for_approval_holds_back_only_its_own_key(database_url: str) -> None:
    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if isinstance(messages[-1].parts[-1], ToolReturnPart):
            return ModelResponse(parts=[TextPart("both done")])
        return ModelResponse(parts=[
            ToolCallPart("pay", {"to": "acme", "amount": 900}, tool_call_id="p"),
            ToolCallPart("notify", {"to": "ops"}, tool_call_id="n"),
        ])

    effects = Effects()

    @effects.effect(topic="payments", key=lambda payment: payment["to"],
                    requires_approval=True)
    def pay(to: str, amount: int) -> dict[str, Any]:
        """Pay."""
        return {"to": to, "amount": amount}

    @effects.effect(topic="notices", key=lambda notice: notice["to"])
    def notify(to: str) -> dict[str, Any]:
        """Notify."""
        return {"to": to}

    durable = Durable(Agent(FunctionModel(script), name="held", output_type=str,
                            toolsets=[effects], capabilities=[OutboxDurability()]))

    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            run = await durable.start(conn, "go", key="held")
        first = await durable.work(engine, worker="w")
        assert first is not None
        assert first.state is RunState.WAITING
        # The notice went out; the payment waits for its approval.
        rows = await outbox_rows(engine)
        assert [r.topic for r in rows] == ["notices"]
        assert "waiting for approval of pay" in (first.reason or "")
        await _confirm(engine, run.id, rows[0].message_id, {"ok": True})
        assert (await durable.work(engine, worker="w")).state is RunState.WAITING  # type: ignore[union-attr]
        assert len(await outbox_rows(engine)) == 1
        [call] = [c for c in (await _checkpoint(engine, run.id))["calls"] if c["tool"] == "pay"]
        async with engine.begin() as conn:
            await aio.grant(conn, call["approval_id"], by="alice", reason="invoice 12")
        paid = await durable.work(engine, worker="w")
        assert paid is not None
        assert paid.state is RunState.WAITING
        rows = await outbox_rows(engine)
        assert [r.topic for r in rows] == ["notices", "payments"]
        await _confirm(engine, run.id, rows[1].message_id, {"paid": True})
        done = await durable.work(engine, worker="w")
        assert done is not None
        assert (done.state, done.output) == (RunState.DONE, "both done")

    drive(database_url, scenario)
