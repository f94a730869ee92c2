"""A durable agent worker as an OS process, for tests/e2e/test_agents_crash.py.

``python -m tests.e2e.agents_crash_worker`` claims the run of its database and drives it with
``outbox_agents.work()`` until the run waits for a confirmation or is done, then prints one
JSON line (the run's state, output and this process's model requests) and exits 0. A
failpoint in ``OUTBOXKIT_FAILPOINTS`` kills it on the way. Environment:

* ``AGENTS_CRASH_DATABASE_URL``: the test's database;
* ``AGENTS_CRASH_REQUESTS``: a file that gets one line per model request, so the test counts
  requests across processes that were SIGKILLed;
* ``AGENTS_CRASH_TOPIC``: the effect's topic;
* ``AGENTS_CRASH_LEASE``: the lease in seconds (short: a killed worker's lease must run out
  before the next worker can claim the run);
* ``AGENTS_CRASH_APPROVAL``: ``1`` when the effect needs a person's approval.

The model is scripted and decides from the message history alone, with fixed tool call ids:
a step asked again after a crash gets the same answer, so the effect's message id
(``effect_message_id(run_id, REORDER_CALL)``) is the same whichever worker sends it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox_agents
from outbox.db.dsn import sqlalchemy_url
from outbox.runs.states import RunState
from outbox_agents import Effects, OutboxDurability
from tests.e2e.agents_crash_consumer import Reorder, reference

NAME = "crash-support"
LOOKUP_CALL = "call-lookup-1"
REORDER_CALL = "call-reorder-1"
PROMPT = "Order A1 is late, please reorder what is missing."
UNCRASHED_REQUESTS = 3
"""lookup_order, then reorder, then the answer: three model requests when nothing crashes."""


ANSWER = f"reordered 3 x widget as {reference('widget', 3)}"
"""The uncrashed run's answer (test_agents_crash.py proves it on an uncrashed run)."""


class Script:
    """The model: the next step from the last message alone; one line in *requests* per call.

    In-process tests only: *hold* is awaited inside the first request (a model call that
    hangs while the lease runs out); *delay* seconds are slept in every request (a slow
    model, so that two workers overlap).
    """

    def __init__(self, requests: Path, hold: Callable[[], Awaitable[None]] | None = None,
                 delay: float = 0.0) -> None:
        self.requests = requests
        self.hold = hold
        self.delay = delay

    async def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        with self.requests.open("a") as f:
            f.write(f"{os.getpid()} {len(messages)}\n")
            f.flush()
            os.fsync(f.fileno())  # the line must survive the SIGKILL that may follow
        if self.hold is not None:
            hold, self.hold = self.hold, None
            await hold()
        if self.delay:
            await asyncio.sleep(self.delay)
        # The last thing the model was told: a request with no parts (pydantic-ai asking
        # again after a history that ends in an answer) is skipped, so such a request gets
        # the same answer as the one before it and shows only in the request count.
        told = [m for m in messages if isinstance(m, ModelRequest) and m.parts]
        last = told[-1].parts[-1]
        result: Any = last.content if isinstance(last, ToolReturnPart) else None
        if isinstance(last, ToolReturnPart) and last.tool_name == "reorder":
            return ModelResponse(parts=[TextPart(
                f"reordered 3 x widget as {result['reference']}")])
        if isinstance(last, ToolReturnPart) and last.tool_name == "lookup_order":
            item = result["item"]
            return ModelResponse(parts=[ToolCallPart(
                "reorder", {"item": item, "qty": 3}, tool_call_id=REORDER_CALL)])
        return ModelResponse(parts=[ToolCallPart(
            "lookup_order", {"order_id": "A1"}, tool_call_id=LOOKUP_CALL)])


def build(topic: str, requests: Path, *, lease_seconds: float,
          hold: Callable[[], Awaitable[None]] | None = None,
          delay: float = 0.0, requires_approval: bool = False) -> Agent[None, str]:
    effects = Effects()

    @effects.effect(topic=topic, key=lambda order: order.item,
                    requires_approval=requires_approval)
    def reorder(item: str, qty: int) -> Reorder:
        """Order *qty* more of *item* from the supplier."""
        return Reorder(item=item, qty=qty)

    # The evidence the confirmation carries ({"reference": ...}) is the tool's return value:
    # the answer quotes only the reference, so it is the same whichever side confirmed.
    agent = Agent(FunctionModel(Script(requests, hold, delay), model_name="crash-script"),
                  name=NAME, instructions="Help with late orders.", output_type=str,
                  toolsets=[effects],
                  capabilities=[OutboxDurability(lease_seconds=lease_seconds)])

    @agent.tool_plain
    def lookup_order(order_id: str) -> dict[str, str]:
        """Look an order up (read-only)."""
        return {"order_id": order_id, "item": "widget", "status": "late"}

    return agent


async def drive(agent: Agent[None, str], engine: AsyncEngine, *, worker: str,
                timeout: float = 60) -> dict[str, Any]:
    """Work the run until it waits or is done. ``work()`` gives None while a killed worker's
    lease still holds the run: try again until it runs out."""
    deadline = time.monotonic() + timeout
    requests = 0
    while time.monotonic() < deadline:
        progress = await outbox_agents.work(engine, agent, worker=worker)
        if progress is not None:
            requests += progress.model_requests
            if progress.state in (RunState.WAITING, RunState.DONE):
                return {"state": progress.state.value, "output": progress.output,
                        "requests": requests, "reason": progress.reason}
            continue  # a lost lease or a retried step: claim again
        async with engine.connect() as conn:
            runs = await conn.execute(
                text("SELECT state FROM outboxkit.agent_runs WHERE workflow = :w"), {"w": NAME})
            states = {row[0] for row in runs}
        if states and states <= {RunState.WAITING.value, RunState.DONE.value}:
            return {"state": states.pop() if len(states) == 1 else sorted(states),
                    "output": None, "requests": requests, "reason": "nothing runnable"}
        await asyncio.sleep(0.1)
    raise SystemExit(f"the run did not wait or end within {timeout} s")


async def main() -> None:
    env = os.environ
    agent = build(env["AGENTS_CRASH_TOPIC"], Path(env["AGENTS_CRASH_REQUESTS"]),
                    lease_seconds=float(env.get("AGENTS_CRASH_LEASE", "2")),
                    requires_approval=env.get("AGENTS_CRASH_APPROVAL") == "1")
    engine = create_async_engine(sqlalchemy_url(env["AGENTS_CRASH_DATABASE_URL"]))
    try:
        result = await drive(agent, engine, worker=f"worker-{os.getpid()}")
    finally:
        await engine.dispose()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
