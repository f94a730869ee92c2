"""The run's journal, and the durable-operation backend that reads and writes it.

pydantic-ai's durable base routes every model request and tool call of a run through
:class:`JournalBackend.execute` as one named *durable unit*. Inside a worker's turn (the
:data:`CURRENT` turn is set) a unit whose result the journal holds returns it without running;
any other runs, and its result is added to the journal:

* a **model response** is written at once, in one fenced statement with the checkpoint, before
  the agent goes on: a worker that resumes the run never asks the model again for it;
* a **tool's result** waits for the next write (a model response, the move to ``waiting`` or
  ``done``), unless the tool took ``checkpoint_tools_after`` seconds or more: read-only tools are
  safe to run again, and a write per fast tool would cost more than running it again after a
  crash;
* a deferred call (an effect not confirmed yet), a cancelled sub-run and an unexpected error
  are not journaled: the unit runs again when the run resumes, and an effect's call then
  returns its confirmation.

Keys are the units' persisted names (pydantic-ai's :class:`JournalOperationNamer`), with the
tool call id for a tool's units (calls of one response run concurrently, in no fixed order) and
an ordinal for a name met again (the run's model requests, one after the other).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Protocol

from pydantic_ai import RunContext
from pydantic_ai.durable_exec import (
    DurableOperationId,
    EventStreamHandlerId,
    JournalCallableOperationBackend,
    ModelRequestId,
    RoleBasedOperationConfig,
    ToolsetGetToolsId,
    ToolsetValidateToolArgumentsId,
    record_durable_unit,
)

MISSING: Any = object()

# Unit results that must be decided again when the run resumes: an effect's call deferred until
# its confirmation, a tool waiting for pydantic-ai's own approval, a cancelled sub-run.
_UNDECIDED = frozenset({"call_deferred", "approval_required", "run_cancelled"})


class Turn(Protocol):
    """What the backend needs of the worker's turn with the run (outbox_agents.runner)."""

    journal: Journal

    def result_of(self, call_id: str) -> Any:
        """The confirmed result of the effect call *call_id*, or :data:`MISSING`."""
        ...

    async def record(self, key: str, payload: Any, *, response: bool, took: float) -> None:
        """Add a unit's result to the journal (and write it now if *response*, or slow)."""
        ...

    async def before_request(self) -> None:
        """A model request is about to be sent (renew the lease if it runs low)."""
        ...


CURRENT: ContextVar[Turn | None] = ContextVar("outboxkit_agent_turn", default=None)
_CALL: ContextVar[str | None] = ContextVar("outboxkit_agent_call", default=None)


def current_call() -> str | None:
    """In a tool's unit: the call's identity in the run (its tool call id, with ``#N`` when
    the model used that id before)."""
    return _CALL.get()


def confirmed_result() -> Any:
    """In an effect tool's unit: the call's confirmed result, or :data:`MISSING`."""
    turn, call_id = CURRENT.get(), _CALL.get()
    if turn is None or call_id is None:
        return MISSING
    return turn.result_of(call_id)


class Journal:
    """The run's recorded unit results by key, and the ones this turn added."""

    def __init__(self, entries: list[Any]) -> None:
        self.recorded: dict[str, Any] = {}
        for entry in entries:
            self.recorded[entry["op"]] = entry["result"]
        self.logged = len(entries)
        self.unwritten: list[dict[str, Any]] = []
        self._met: dict[str, int] = {}

    def key(self, name: str, call_id: str | None) -> tuple[str, str]:
        """The unit's key, and the base whose ordinal it took (:meth:`release` gives it back)."""
        base = name if call_id is None else f"{name}@{call_id}"
        met = self._met.get(base, 0)
        self._met[base] = met + 1
        return (base if met == 0 else f"{base}#{met}"), base

    def release(self, base: str) -> None:
        """A unit that raised took no ordinal: its retry (pydantic-ai's own, a fallback
        model's) is the one the journal keeps, under the key a replay asks for first."""
        self._met[base] -= 1

    def add(self, key: str, payload: Any) -> None:
        self.recorded[key] = payload
        self.unwritten.append({"op": key, "result": payload})

    def taken(self) -> tuple[dict[int, Any], int]:
        """The unwritten entries by sequence number, and how many there will be."""
        batch = {self.logged + i: entry for i, entry in enumerate(self.unwritten)}
        return batch, self.logged + len(batch)

    def written(self, count: int) -> None:
        """The first entries up to *count* committed."""
        del self.unwritten[:count - self.logged]
        self.logged = count



def _call_id(cache_key: tuple[object, ...]) -> str | None:
    for part in cache_key:
        if isinstance(part, RunContext):
            return part.tool_call_id
    return None


def _unjournaled(operation_id: DurableOperationId) -> bool:
    """Units run again at every turn instead of journaled: validating a tool's arguments and
    listing a function toolset's tools (functions of their inputs), and the event stream
    handler (its events have no stable identity across turns: a replay hands the handler the
    run's events again, so it sees them at least once)."""
    if isinstance(operation_id, ToolsetValidateToolArgumentsId | EventStreamHandlerId):
        return True
    return isinstance(operation_id, ToolsetGetToolsId) and operation_id.toolset_kind == "function"


class JournalBackend(JournalCallableOperationBackend[None]):
    """pydantic-ai's callable backend on the run's journal."""

    def __init__(self, *, agent_name: str, default_model_id: str | None) -> None:
        super().__init__(agent_name=agent_name, default_model_id=default_model_id,
                         config=RoleBasedOperationConfig(model=None, event=None,
                                                         capability=None, tool=None))

    async def execute(self, *, operation_id: DurableOperationId, name: str,
                      body: Callable[[], Awaitable[object]], cache_key: tuple[object, ...],
                      config: None) -> object:
        turn = CURRENT.get()
        if turn is None or _unjournaled(operation_id):
            return await body()
        call_id = _call_id(cache_key)
        key, base = turn.journal.key(name, call_id)
        if key in turn.journal.recorded:
            record_durable_unit(executed=False)
            return turn.journal.recorded[key]
        response = isinstance(operation_id, ModelRequestId)
        if response:
            await turn.before_request()
        # An effect's identity is its unit's: a model that reuses a tool call id in a later
        # response (pydantic-ai's TestModel does) asks for another effect.
        token = _CALL.set(None if call_id is None else key[len(name) + 1:])
        started = time.monotonic()
        try:
            payload = await body()
        except BaseException:
            turn.journal.release(base)
            raise
        finally:
            _CALL.reset(token)
        if isinstance(payload, dict) and payload.get("kind") in _UNDECIDED:
            return payload
        record_durable_unit(executed=True)
        await turn.record(key, payload, response=response, took=time.monotonic() - started)
        return payload
