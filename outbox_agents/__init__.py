"""Durable pydantic-ai agents on outboxkit (``pip install outboxkit[pydantic-ai]``).

Add the capability to any pydantic-ai agent::

    agent = Agent(model, name="support", toolsets=[effects],
                  capabilities=[OutboxDurability()])

Each run is an outboxkit run (a fenced lease; every model response journaled in the run's log
before the agent goes on), and the tools in :class:`Effects` act on the outside world only
through the outbox: calling one writes a Kafka message with the run's move to ``waiting``, and
the agent resumes with the confirmed result. Start runs with :func:`start`, run them on a
worker (:meth:`outbox.App.register_agent`). See docs/agents.md.

This package imports pydantic-ai; ``outbox``, ``relay``, ``consumers`` and ``dedup`` never
import it.
"""

from outbox_agents.capability import DEFAULT_RETRY, OutboxDurability
from outbox_agents.effects import Effects
from outbox_agents.runner import Progress
from outbox_agents.runs import output, start, work
from outbox_agents.state import AgentState, Call, effect_message_id
from outbox_agents.version import AgentVersion, agent_version

from outbox import app as _app  # isort: skip
from outbox_agents.capability import _adapt  # isort: skip

_app.agent_adapters.append(_adapt)

__all__ = [
    "DEFAULT_RETRY",
    "AgentState",
    "AgentVersion",
    "Call",
    "Effects",
    "OutboxDurability",
    "Progress",
    "agent_version",
    "effect_message_id",
    "output",
    "start",
    "work",
]
