"""What a durable agent run keeps in its checkpoint, and how it is read back.

The checkpoint is the run's whole memory: the prompt, pydantic-ai's message history (as
pydantic-ai serialises it), the tool calls the run waits for (an effect's message, an
approval), and the results a resume feeds back to the agent. A worker that claims the run
rebuilds the agent's position from it alone: no chat history in process memory, no replay.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter

FORMAT = 1


class Pending(BaseModel):
    """A tool call the run waits for.

    ``effect``: a message (``message_id``, ``topic``, ``type``, ``key``, ``payload``) whose
    confirmation, applied under the message id as confirmation id, is the tool's result.
    ``approval``: an approval (``approval_id``) of ``scope`` a person must grant.
    """

    kind: Literal["effect", "approval"]
    call_id: str
    tool: str
    message_id: uuid.UUID | None = None
    topic: str | None = None
    type: str | None = None
    key: str | None = None
    payload: Any = None
    emitted: bool = False
    approval_id: uuid.UUID | None = None
    scope: dict[str, Any] | None = None


class AgentState(BaseModel):
    """The checkpoint of a durable agent run (``format`` guards against other layouts)."""

    format: int = FORMAT
    prompt: str | None = None
    messages: list[Any] = Field(default_factory=list)
    pending: list[Pending] = Field(default_factory=list)
    results: dict[str, Any] = Field(default_factory=dict)
    """Effect results to resume with, by tool call id (the confirmation's evidence)."""
    approved: list[str] = Field(default_factory=list)
    """Approval calls granted and revalidated, to resume with."""
    output: Any = None

    def history(self) -> list[ModelMessage]:
        """The message history as pydantic-ai objects."""
        return ModelMessagesTypeAdapter.validate_python(self.messages)

    def with_history(self, messages: list[ModelMessage]) -> AgentState:
        """This state with *messages* as its history."""
        dumped = ModelMessagesTypeAdapter.dump_python(messages, mode="json")
        return self.model_copy(update={"messages": dumped})

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def effect_message_id(run_id: uuid.UUID, call_id: str) -> uuid.UUID:
    """The message id of the effect a tool call asks for: the same for the same call of the
    same run, so a call made again after a crash before its commit is the same message."""
    return uuid.uuid5(run_id, f"tool-call:{call_id}")
