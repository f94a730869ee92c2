"""The durable agent's pure parts: effect registration, the pinned version, the checkpoint."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart
from pydantic_ai.models.function import FunctionModel

from outbox.errors import ConfigurationError
from outbox_agents import (
    AgentState,
    Call,
    Effects,
    OutboxDurability,
    agent_version,
    effect_message_id,
    start,
)
from outbox_agents.journal import Journal


def _reply(messages: Any, info: Any) -> ModelResponse:
    return ModelResponse(parts=[TextPart("ok")])


def _agent(instructions: str = "Help.", model: Any = None, **kwargs: Any) -> Agent[None, str]:
    return Agent(model or FunctionModel(_reply), name="a", instructions=instructions,
                 output_type=str, **kwargs)


def _effects(*, approval: bool = False, extra: bool = False) -> Effects:
    effects = Effects()
    if extra:
        @effects.effect(topic="t", requires_approval=approval)
        def order(item: str, qty: int, note: str = "") -> dict[str, Any]:
            """Order."""
            return {"item": item}
    else:
        @effects.effect(topic="t", requires_approval=approval)
        def order(item: str, qty: int) -> dict[str, Any]:  # type: ignore[misc]
            """Order."""
            return {"item": item}
    return effects


def test_an_effect_needs_a_topic_a_plain_function_and_a_unique_name() -> None:
    effects = Effects()
    with pytest.raises(ConfigurationError, match="topic"):
        effects.effect(topic="")

    async def later(x: int) -> int:
        return x

    with pytest.raises(ConfigurationError, match="async"):
        effects.effect(topic="t")(later)

    def once(x: int) -> int:
        return x

    effects.effect(topic="t")(once)
    with pytest.raises(ConfigurationError, match="twice"):
        effects.effect(topic="t")(once)
    assert effects.specs["once"].type == "once"
    assert "once" in effects.tools


def test_a_durable_agent_needs_a_name_and_sane_options() -> None:
    with pytest.raises(Exception, match="name"):
        Agent(FunctionModel(_reply), output_type=str, capabilities=[OutboxDurability()])
    for bad, message in [({"lease_seconds": 0}, "lease_seconds"),
                         ({"checkpoint_tools_after": -1}, "checkpoint_tools_after"),
                         ({"approval_expires": timedelta(0)}, "approval_expires")]:
        with pytest.raises(ConfigurationError, match=message):
            OutboxDurability(**bad)  # type: ignore[arg-type]
    nameless = Agent(FunctionModel(_reply), output_type=str,
                     capabilities=[OutboxDurability(name="named")])
    assert OutboxDurability.from_agent(nameless).workflow.name == "named"  # type: ignore[union-attr]


def test_an_empty_prompt_is_refused_before_anything_is_sent() -> None:
    agent = _agent(capabilities=[OutboxDurability()])
    with pytest.raises(ConfigurationError, match="prompt"):
        asyncio.run(start(None, agent, "", key="k"))  # type: ignore[arg-type]


def test_an_agent_without_the_capability_is_named_in_the_error() -> None:
    with pytest.raises(ConfigurationError, match="no OutboxDurability"):
        asyncio.run(start(None, _agent(), "hi", key="k"))  # type: ignore[arg-type]


def test_the_pinned_version_follows_model_instructions_and_tool_schemas() -> None:
    base = agent_version(_agent(), [_effects()])
    assert base == agent_version(_agent(), [_effects()])
    prompt = agent_version(_agent("Be brief."), [_effects()])
    assert (prompt.version, prompt.prompt_version) != (base.version, base.prompt_version)
    assert prompt.tool_schema_version == base.tool_schema_version
    schema = agent_version(_agent(), [_effects(extra=True)])
    assert schema.tool_schema_version != base.tool_schema_version
    approval = agent_version(_agent(), [_effects(approval=True)])
    assert approval.tool_schema_version != base.tool_schema_version

    def other_reply(messages: Any, info: Any) -> ModelResponse:
        return ModelResponse(parts=[TextPart("ok")])

    model = agent_version(_agent(model=FunctionModel(other_reply)), [_effects()])
    assert model.version != base.version
    assert model.prompt_version == base.prompt_version
    explicit = _agent(capabilities=[OutboxDurability(version="2026-12")])
    assert OutboxDurability.from_agent(explicit).workflow.version == "2026-12"  # type: ignore[union-attr]


def test_an_effect_call_keeps_its_message_id() -> None:
    run = uuid.uuid4()
    assert effect_message_id(run, "call-1") == effect_message_id(run, "call-1")
    assert effect_message_id(run, "call-1") != effect_message_id(run, "call-2")
    assert effect_message_id(run, "call-1") != effect_message_id(uuid.uuid4(), "call-1")


def test_the_journal_keys_a_name_met_again_by_ordinal_and_a_tool_by_its_call() -> None:
    journal = Journal([{"op": "a__model.request", "result": {"n": 0}}])
    assert journal.key("a__model.request", None) == ("a__model.request", "a__model.request")
    assert journal.key("a__model.request", None)[0] == "a__model.request#1"
    # A unit that raised gives its ordinal back: its retry takes the same key.
    key, base = journal.key("a__model.request", None)
    assert key == "a__model.request#2"
    journal.release(base)
    assert journal.key("a__model.request", None)[0] == "a__model.request#2"
    assert journal.key("a__call_tool:x", "c1")[0] == "a__call_tool:x@c1"
    assert journal.key("a__call_tool:x", "c2")[0] == "a__call_tool:x@c2"
    assert journal.key("a__call_tool:x", "c1")[0] == "a__call_tool:x@c1#1"
    assert journal.recorded == {"a__model.request": {"n": 0}}
    journal.add("a__model.request#1", {"n": 1})
    journal.add("a__call_tool:x@c1", {"n": 2})
    batch, count = journal.taken()
    assert (sorted(batch), count) == ([1, 2], 3)
    journal.written(2)  # the first one committed; the second is still to write
    assert journal.taken() == ({2: {"op": "a__call_tool:x@c1", "result": {"n": 2}}}, 3)


def test_the_checkpoint_round_trips() -> None:
    call = Call(call_id="c1", tool="order", message_id=uuid.uuid4(), topic="t", type="order",
                args={"item": "w"}, approval=True, digest="sha256:00")
    state = AgentState(prompt="hi", logged=3, deps={"shop": 1}, calls=[call])
    assert AgentState.model_validate(state.dump()) == state
