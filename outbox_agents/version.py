"""The version a durable agent's runs pin: its model, instructions and tools, hashed.

A run started under one version and resumed by a worker whose agent differs (another model,
new instructions, a changed tool schema) is a version change: the workflow's
:class:`~outbox.runs.workflows.VersionPolicy` decides (go on, migrate the checkpoint, or send the
run to ``needs-human`` for review, the default).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic_ai.agent import AbstractAgent
from pydantic_ai.toolsets import AbstractToolset


@dataclass(frozen=True)
class AgentVersion:
    """The three pinned versions (12 hex digits each)."""

    version: str
    prompt_version: str
    tool_schema_version: str


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _described(part: Any) -> Any:
    """A stable description of an instruction or system prompt: its text, or a function's
    qualified name (its output may vary per run; its identity is what the code pins)."""
    if isinstance(part, str):
        return part
    func = getattr(part, "function", part)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _prompts(agent: AbstractAgent[Any, Any]) -> list[Any]:
    # pydantic-ai keeps instructions and system prompts in private attributes; read them
    # defensively: a version missing here still pins the model and the tools.
    parts: list[Any] = []
    for attribute in ("_instructions", "_system_prompts", "_system_prompt_functions"):
        value = getattr(agent, attribute, None)
        if value is None:
            continue
        for part in value if isinstance(value, list | tuple) else [value]:
            parts.append(_described(part))
    return parts


def _tool_schemas(toolsets: Iterable[AbstractToolset[Any]]) -> list[Any]:
    schemas: list[Any] = []
    for toolset in toolsets:
        tools = getattr(toolset, "tools", None)
        if not isinstance(tools, dict):
            schemas.append({"toolset": type(toolset).__name__, "id": toolset.id})
            continue
        for name, tool in sorted(tools.items()):
            definition = tool.tool_def
            schemas.append({"name": name, "description": definition.description,
                            "parameters": definition.parameters_json_schema,
                            "approval": bool(tool.requires_approval),
                            "metadata": definition.metadata})
    return schemas


def model_name(agent: AbstractAgent[Any, Any]) -> str:
    model = agent.model
    if model is None:
        return "none"
    return model if isinstance(model, str) else f"{model.system}:{model.model_name}"


def agent_version(agent: AbstractAgent[Any, Any],
                  extra: Iterable[AbstractToolset[Any]] = ()) -> AgentVersion:
    """Hash what changes an agent's behaviour for runs already under way."""
    prompt = _digest(_prompts(agent))
    tools = _digest(_tool_schemas([*agent.toolsets, *extra]))
    output = repr(agent.output_type)
    return AgentVersion(version=_digest([model_name(agent), prompt, tools, output]),
                        prompt_version=prompt, tool_schema_version=tools)
