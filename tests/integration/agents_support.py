"""A scripted support agent for the durable-agent tests: FunctionModel, no network.

The script decides from the message history alone, so a step asked again gives the same
answer, and it counts every request it answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox_agents
from outbox.db.dsn import sqlalchemy_url
from outbox.db.execution import AsyncConn
from outbox.runs.lifecycle import Run
from outbox.runs.workflows import Workflow
from outbox_agents import Effects, OutboxDurability, Progress

T = TypeVar("T")


class Reorder(BaseModel):
    item: str
    qty: int


@dataclass
class Script:
    """The model's side: what it asks for next, given what it has seen."""

    reorder_args: dict[str, Any] = field(default_factory=lambda: {"item": "widget", "qty": 3})
    fixed_args: dict[str, Any] | None = None
    """After a retry prompt for bad arguments, call again with these."""
    requests: list[int] = field(default_factory=list)
    hold: asyncio.Event | None = None
    fail_at: int | None = None
    """The request (1-based) that fails once, as a model provider's outage would."""

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(len(messages))
        if len(self.requests) == self.fail_at:
            raise ConnectionError("the model provider is unreachable")
        if self.hold is not None:
            await self.hold.wait()
        last = messages[-1].parts[-1]
        retry = isinstance(last, RetryPromptPart) or (
            isinstance(last, ToolReturnPart) and last.retry is not None)
        if retry and self.fixed_args is not None:
            return ModelResponse(parts=[ToolCallPart("reorder", self.fixed_args)])
        if isinstance(last, ToolReturnPart) and last.tool_name == "reorder":
            return ModelResponse(parts=[TextPart(f"reordered: {last.content}")])
        if isinstance(last, ToolReturnPart):
            return ModelResponse(parts=[ToolCallPart("reorder", self.reorder_args)])
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "A1"})])


@dataclass
class Durable:
    """An agent with the capability, and the three calls the tests make on it."""

    agent: Agent[Any, Any]

    @property
    def workflow(self) -> Workflow:
        return OutboxDurability.from_agent(self.agent).workflow  # type: ignore[union-attr]

    async def start(self, conn: AsyncConn, prompt: str, *, key: str, deps: Any = None) -> Run:
        return await outbox_agents.start(conn, self.agent, prompt, key=key, deps=deps)

    async def work(self, engine: AsyncEngine, *, worker: str,
                   deps: Any = None) -> Progress | None:
        return await outbox_agents.work(engine, self.agent, worker=worker, deps=deps)

    async def output(self, conn: AsyncConn, run_id: Any) -> Any:
        return await outbox_agents.output(conn, self.agent, run_id)


def support_agent(script: Script, *, instructions: str = "Help with orders.",
                  requires_approval: bool = False, lookup: Callable[[str], Any] | None = None,
                  **durable: Any) -> Durable:
    effects = Effects()

    @effects.effect(topic="supplier.orders", key=lambda order: order.item,
                    requires_approval=requires_approval)
    def reorder(item: str, qty: int) -> Reorder:
        """Order more of an item from the supplier."""
        return Reorder(item=item, qty=qty)

    agent = Agent(FunctionModel(script), name="support", instructions=instructions,
                  output_type=str, toolsets=[effects],
                  capabilities=[OutboxDurability(**durable)])

    @agent.tool_plain
    def lookup_order(order_id: str) -> dict[str, str]:
        """Look an order up."""
        if lookup is not None:
            lookup(order_id)
        return {"order_id": order_id, "item": "widget", "status": "late"}

    return Durable(agent)


def drive(database_url: str, scenario: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """Run *scenario* on an async engine of the test database, in one event loop."""

    async def main() -> T:
        engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            return await scenario(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


async def outbox_rows(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        result = await conn.execute(text(
            "SELECT message_id, topic, key, payload, run_id FROM outboxkit.outbox_messages "
            "ORDER BY id"))
        return list(result.all())
