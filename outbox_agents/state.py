"""What a durable agent run keeps in its checkpoint, and how its journal is read back.

The checkpoint and the run's log are the run's whole memory. The log is the journal: one
entry per durable unit that completed (a model response, a tool's result), keyed by the
unit's persisted name. A worker that claims the run runs the agent again from its prompt, and
every unit already in the journal returns its recorded result instead of running: the model
is never asked again for a response that committed. The checkpoint holds the prompt, the
run's dependencies (as JSON), how many journal entries are the run's, and the effect calls
the run asked for (their messages, approvals and whether they went out).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, Field

FORMAT = 2


class Call(BaseModel):
    """An effect tool call the run asked for: a message whose confirmation (applied under
    the message id as confirmation id) is the tool's result.

    With ``approval`` it first needs a person's approval of ``digest`` (the tool and its
    exact arguments), spent in the transaction that sends the message.
    """

    call_id: str
    tool: str
    message_id: uuid.UUID
    topic: str
    type: str
    key: str | None = None
    payload: Any = None
    args: dict[str, Any] = Field(default_factory=dict)
    approval: bool = False
    digest: str | None = None
    approval_id: uuid.UUID | None = None
    sent: bool = False


class AgentState(BaseModel):
    """The checkpoint of a durable agent run (``format`` guards against other layouts)."""

    format: int = FORMAT
    prompt: str
    deps: Any = None
    """The run's dependencies as JSON (``start(..., deps=...)``), rebuilt at every turn."""
    history: list[Any] | None = None
    """The conversation the run goes on from (``start(..., message_history=...)``), as
    pydantic-ai serialises it."""
    logged: int = 0
    """How many journal entries (the run's log) are this state's."""
    calls: list[Call] = Field(default_factory=list)
    output: Any = None

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def effect_message_id(run_id: uuid.UUID, call_id: str) -> uuid.UUID:
    """The message id of the effect a tool call asks for: the same for the same call of the
    same run, so a call made again after a crash before its commit is the same message."""
    return uuid.uuid5(run_id, f"tool-call:{call_id}")
