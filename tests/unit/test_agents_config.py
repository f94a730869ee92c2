"""The durable agent's pure parts: effect registration, the pinned version, the checkpoint."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from unittest.mock import ANY

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import FunctionModel

from outbox.errors import ConfigurationError
from outbox_agents import AgentState, DurableAgent, Effects, agent_version, effect_message_id
from outbox_agents.state import History, messages_from


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


def test_a_durable_agent_needs_a_name_and_a_positive_lease() -> None:
    nameless = Agent(FunctionModel(_reply), output_type=str)
    with pytest.raises(ConfigurationError, match="name"):
        DurableAgent(nameless)
    with pytest.raises(ConfigurationError, match="lease_seconds"):
        DurableAgent(_agent(), lease_seconds=0)
    assert DurableAgent(nameless, name="named").name == "named"


def test_an_empty_prompt_is_refused_before_anything_is_sent() -> None:
    durable = DurableAgent(_agent())
    with pytest.raises(ConfigurationError, match="prompt"):
        asyncio.run(durable.start(None, "", key="k"))  # type: ignore[arg-type]


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
    explicit = DurableAgent(_agent(), version="2026-12")
    assert explicit.workflow.version == "2026-12"


def test_an_effect_call_keeps_its_message_id() -> None:
    run = uuid.uuid4()
    assert effect_message_id(run, "call-1") == effect_message_id(run, "call-1")
    assert effect_message_id(run, "call-1") != effect_message_id(run, "call-2")
    assert effect_message_id(run, "call-1") != effect_message_id(uuid.uuid4(), "call-1")


def test_only_new_messages_and_a_request_not_yet_sent_go_to_the_log() -> None:
    prompt = ModelRequest.user_text_prompt("hi")
    call = ModelResponse(parts=[ToolCallPart("order", {"item": "w"}, tool_call_id="c1")])
    history = History([])
    assert history.delta([prompt]) == {0: ANY}
    history.committed([prompt])
    # The request may have been completed when it was sent: written again with the response.
    assert set(history.delta([prompt, call])) == {0, 1}
    history.committed([prompt, call])
    answer = ModelResponse(parts=[TextPart("done")])
    assert set(history.delta([prompt, call, answer])) == {2}
    # Another object at a logged position (a resumed run's copy) is written again.
    assert set(history.delta([prompt, ModelResponse(parts=call.parts), answer])) == {1, 2}
    # What is written reads back as the same messages.
    assert messages_from(list(History([]).delta([prompt, call]).values())) == [prompt, call]


def test_the_checkpoint_round_trips() -> None:
    state = AgentState(prompt="hi", logged=3, approved=["c1"], results={"c2": {"ok": 1}})
    assert AgentState.model_validate(state.dump()) == state
