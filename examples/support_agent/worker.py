"""The support agent's worker: the app ``outbox worker`` runs.

    OUTBOXKIT_DATABASE_URL=postgresql://... outbox worker examples.support_agent.worker:app

It claims the agent's runs and drives each until it waits or ends (``outbox worker --help``
for concurrency, health endpoints, the shutdown grace). SIGTERM or SIGINT stop it once the
turns in hand reach a commit point. A worker killed outright loses nothing that committed:
its runs' leases expire and a worker (this one, restarted) takes each over from its last
checkpoint. With ``OUTBOXKIT_AGENT_MODEL`` set it drives the agent of :mod:`.real_model`
instead of the scripted one.
"""

from __future__ import annotations

import os

from pydantic_ai import Agent

from outbox import App


def the_agent() -> Agent[None, str]:
    if os.environ.get("OUTBOXKIT_AGENT_MODEL"):
        from examples.support_agent.real_model import live_agent  # noqa: PLC0415

        return live_agent()
    from examples.support_agent.agent import agent  # noqa: PLC0415

    return agent


app = App()
app.register_agent(the_agent())
