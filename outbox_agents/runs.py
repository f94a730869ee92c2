"""Starting a durable agent's runs, working one, and reading its output.

Each function takes the agent itself (built with ``capabilities=[OutboxDurability()]``); a
worker runs the agent's runs for you (:meth:`outbox.App.register_agent`), :func:`work` is one
turn by hand (scripts, tests, benchmarks).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from pydantic import TypeAdapter
from pydantic_ai.agent import AbstractAgent
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_core import PydanticSerializationError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio
from outbox.db.execution import AsyncConn
from outbox.errors import ConfigurationError
from outbox.runs.lifecycle import Run
from outbox.runs.states import RunState
from outbox_agents import runner
from outbox_agents.capability import durability_of
from outbox_agents.state import AgentState

OutputT = TypeVar("OutputT")


async def start(conn: AsyncConn, agent: AbstractAgent[Any, Any], prompt: str, *, key: str,
                deps: Any = None, message_history: Sequence[ModelMessage] | None = None) -> Run:
    """Queue a run of *agent* on *prompt*, or return the run *key* already started; in the
    caller's transaction (never commits). *deps* is stored with the run (as JSON, by the
    agent's ``deps_type``) and rebuilt at every turn, so a resumed run has it too;
    *message_history* (an earlier conversation the run goes on from) is stored with it."""
    if not isinstance(prompt, str) or not prompt:
        raise ConfigurationError("prompt must be a non-empty string")
    durability = durability_of(agent)
    runner.run_output_type(agent)  # an agent no turn can run is refused before its run exists
    stored = None
    if deps is not None:
        if agent.deps_type is type(None):
            raise ConfigurationError(
                f"agent {agent.name!r} has no deps_type: give Agent(..., deps_type=...) to "
                "store deps with its runs")
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(agent.deps_type)
            stored = adapter.dump_python(deps, mode="json", warnings="error")
            adapter.validate_python(stored)  # every turn rebuilds them so: refuse it now
        except (PydanticSerializationError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"the run's deps ({type(deps).__name__}) do not round-trip as JSON: store "
                "what identifies them and rebuild them with "
                "OutboxDurability(rebuild_deps=...)") from exc
    history = (ModelMessagesTypeAdapter.dump_python(list(message_history), mode="json")
               if message_history else None)
    workflow = durability.workflow
    return await aio.start_run(
        conn, workflow=workflow.name, workflow_version=workflow.version, idempotency_key=key,
        checkpoint=AgentState(prompt=prompt, deps=stored, history=history).dump(),
        prompt_version=workflow.prompt_version, tool_schema_version=workflow.tool_schema_version,
        settings=durability.settings)


_registered: set[tuple[int, int]] = set()


async def work(engine: AsyncEngine, agent: AbstractAgent[Any, Any], *, worker: str,
               deps: Any = None) -> runner.Progress | None:
    """Claim one runnable run of *agent* and drive it until it waits, needs a person, or
    ends; ``None`` when no run is runnable. Commits as it goes."""
    durability = durability_of(agent)
    settings = durability.settings
    if (id(engine), id(durability)) not in _registered:
        async with engine.begin() as conn:
            await aio.register(conn, durability.workflow, settings=settings)
        _registered.add((id(engine), id(durability)))
    async with engine.begin() as conn:
        job = await aio.claim(conn, worker=worker, lease_seconds=durability.lease_seconds,
                              workflows=[durability.workflow], settings=settings)
    if job is None:
        return None
    return await runner.turn(durability, engine, job.run, job.lease, settings=settings,
                             deps=deps)


async def output(conn: AsyncConn, agent: AbstractAgent[Any, OutputT],
                 run_id: uuid.UUID) -> OutputT:
    """The output of *agent*'s finished run *run_id*, as the agent's output type."""
    durability = durability_of(agent)
    run = await aio.get_run(conn, run_id, settings=durability.settings)
    if run.state is not RunState.DONE:
        raise ConfigurationError(
            f"run {run_id} is {run.state.value}, not done: it has no output yet")
    value = AgentState.model_validate(run.checkpoint).output
    kind: Any = agent.output_type
    if not isinstance(kind, type):  # ToolOutput(...), a union list: the JSON as stored
        return cast(OutputT, value)
    adapter: TypeAdapter[OutputT] = TypeAdapter(kind)
    return adapter.validate_python(value)
