"""What a durable agent run keeps in its checkpoint, and how it is read back.

The checkpoint and the run's log are the run's whole memory: the prompt, the tool calls the
run waits for (an effect's message, an approval), the results a resume feeds back to the
agent, and (in the log, as pydantic-ai serialises it) the message history. A worker that
claims the run rebuilds the agent's position from them alone: no chat history in process
memory, no replay.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelRequest

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
    """The checkpoint of a durable agent run (``format`` guards against other layouts).

    The message history is not in it: it is the run's log (:mod:`outbox.runs.runlog`), one entry
    per message, of which the first ``logged`` are this state's.
    """

    format: int = FORMAT
    prompt: str | None = None
    logged: int = 0
    pending: list[Pending] = Field(default_factory=list)
    results: dict[str, Any] = Field(default_factory=dict)
    """Effect results to resume with, by tool call id (the confirmation's evidence)."""
    approved: list[str] = Field(default_factory=list)
    """Approval calls granted and revalidated, to resume with."""
    output: Any = None

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def messages_from(entries: list[Any]) -> list[ModelMessage]:
    """The log's entries as pydantic-ai messages."""
    return ModelMessagesTypeAdapter.validate_python(entries)


class History:
    """Which messages of a growing history still have to go to the run's log.

    A save writes only the messages the log does not have yet, and the newest one it has if
    that is a request: pydantic-ai completes the request it is about to send (its
    instructions, its timestamp) after the checkpoint that saved it. A message counts as
    logged when it is the very object a committed save wrote.
    """

    def __init__(self, logged: list[ModelMessage]) -> None:
        self._logged = list(logged)

    def delta(self, messages: list[ModelMessage]) -> dict[int, Any]:
        """The log entries to write for *messages*, by sequence number."""
        changed = [index for index, message in enumerate(messages)
                   if index >= len(self._logged) or self._logged[index] is not message
                   or (index == len(self._logged) - 1 and isinstance(message, ModelRequest))]
        dumped = ModelMessagesTypeAdapter.dump_python([messages[i] for i in changed],
                                                      mode="json")
        return dict(zip(changed, dumped, strict=True))

    def committed(self, messages: list[ModelMessage]) -> None:
        """A save of *messages* committed."""
        self._logged = list(messages)


def effect_message_id(run_id: uuid.UUID, call_id: str) -> uuid.UUID:
    """The message id of the effect a tool call asks for: the same for the same call of the
    same run, so a call made again after a crash before its commit is the same message."""
    return uuid.uuid5(run_id, f"tool-call:{call_id}")
