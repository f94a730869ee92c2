"""The support agent on a real model provider, chosen by environment variable.

    pip install 'pydantic-ai-slim[openai]'
    export OUTBOXKIT_AGENT_MODEL=openai:gpt-4o-mini OPENAI_API_KEY=sk-...
    export OUTBOXKIT_DATABASE_URL=postgresql://...
    python -m examples.support_agent.real_model "Where is my order A-1001?"

That queues one run; the worker (``outbox worker examples.support_agent.worker:app``, which drives
this agent whenever ``OUTBOXKIT_AGENT_MODEL`` is set), the relay and the consumer of the
example take it from there, exactly as with the scripted model. Any pydantic-ai model name
works (``anthropic:claude-...``, ``google-gla:gemini-...``, each with its provider's key
variable). Nothing here touches the network until the worker asks the model.

The runs belong to their own workflow, ``support-live``: they pin the model's name, so the
scripted worker of the demo never picks them up.
"""

from __future__ import annotations

import asyncio
import os
import sys

from pydantic_ai import Agent
from pydantic_ai.exceptions import UserError
from sqlalchemy.ext.asyncio import create_async_engine

import outbox_agents
from examples.support_agent.agent import support_agent
from outbox.db.dsn import sqlalchemy_url

MODEL = "OUTBOXKIT_AGENT_MODEL"
HOW = f"""set {MODEL} to a pydantic-ai model name and that provider's API key, e.g.

    export {MODEL}=openai:gpt-4o-mini OPENAI_API_KEY=sk-...
    export {MODEL}=anthropic:claude-3-5-haiku-latest ANTHROPIC_API_KEY=...

(with the provider's extra installed: pip install 'pydantic-ai-slim[openai]'), and
OUTBOXKIT_DATABASE_URL to the PostgreSQL URL."""


def live_agent() -> Agent[None, str]:
    """The agent on the model ``OUTBOXKIT_AGENT_MODEL`` names (a minute's lease: a real
    model answers in seconds, not milliseconds)."""
    return support_agent(os.environ[MODEL], name="support-live", lease_seconds=60.0)


async def start(database_url: str, prompt: str) -> None:
    agent = live_agent()
    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        async with engine.begin() as conn:
            run = await outbox_agents.start(conn, agent, prompt, key=f"live:{prompt}")
    finally:
        await engine.dispose()
    print(f"run {run.id} queued ({run.state.value}); the worker drives it")


def main(argv: list[str]) -> int:
    database_url = os.environ.get("OUTBOXKIT_DATABASE_URL")
    if not os.environ.get(MODEL) or not database_url:
        print(HOW)
        return 2
    prompt = " ".join(argv) or "Where is my order A-1001? It has not shipped."
    try:
        asyncio.run(start(database_url, prompt))
    except (ImportError, UserError) as exc:  # the provider's package or key is missing
        print(f"{exc}\n\n{HOW}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
