"""Durable pydantic-ai agents on outboxkit (``pip install outboxkit[pydantic-ai]``).

Wrap any pydantic-ai ``Agent`` in :class:`DurableAgent`: each run is an outboxkit run (a
fenced lease, the message history checkpointed at every model response and tool result),
and the tools in :class:`Effects` act on the outside world only through the outbox: calling
one writes a Kafka message with the run's move to ``waiting``, and the agent resumes with
the confirmed result. See docs/agents.md.

This package imports pydantic-ai; ``outbox``, ``relay``, ``consumers`` and ``dedup`` never
import it.
"""

from outbox_agents.durable import DEFAULT_RETRY, DurableAgent, Progress
from outbox_agents.effects import Effects
from outbox_agents.state import AgentState, Pending, effect_message_id
from outbox_agents.version import AgentVersion, agent_version

__all__ = [
    "DEFAULT_RETRY",
    "AgentState",
    "AgentVersion",
    "DurableAgent",
    "Effects",
    "Pending",
    "Progress",
    "agent_version",
    "effect_message_id",
]
