"""A pydantic-ai agent run as a durable outboxkit run.

:class:`DurableAgent` wraps any pydantic-ai ``Agent``. ``start`` queues a run (an outboxkit
run with an idempotency key, in the caller's transaction); ``work`` claims one with a fenced
lease and drives the agent with pydantic-ai's own graph iteration (``Agent.iter``), one node
at a time, committing at every step boundary:

* after each **model response**, the message history is checkpointed (its own transaction):
  a worker that resumes the run starts from that response and never asks the model again for
  a step that committed;
* after each round of **read-only tool calls**, the history with their results is
  checkpointed before the next model request;
* a call to an **effect tool** (:class:`outbox_agents.Effects`) is deferred by pydantic-ai; its
  message goes to the outbox in the one transaction that also saves the checkpoint and
  moves the run to ``waiting``. When the consumer side confirms (``apply_confirmation`` /
  ``ctx.confirm``, or the operations ledger with ``on_settle="resume"``), the run is
  runnable again and the agent resumes with the confirmation's evidence as the tool's return
  value (pydantic-ai's ``DeferredToolResults``). Effects go out one at a time, in the order
  the model asked for them, each confirmed before the next is sent;
* a tool that **requires approval** asks for an outboxkit approval that expires; the run
  waits, and a resumed run revalidates it (expired, revoked: ``needs-human``).

Every write carries the lease: a worker whose lease was taken over writes nothing more
(``LeaseLost``) and stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar, cast

from pydantic import TypeAdapter, ValidationError
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults
from pydantic_ai.exceptions import UserError
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    ToolCallPart,
    ToolReturnPart,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox import aio
from outbox.aio import AsyncClaimedRun
from outbox.db.execution import AsyncConn
from outbox.errors import ConfigurationError, InvalidMessage, LeaseLost, LeaseSpent
from outbox.messages.envelope import Envelope
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import Run
from outbox.runs.retry import RetryPolicy
from outbox.runs.states import RunState
from outbox.runs.workflows import Migration, VersionPolicy, Workflow
from outbox.runtime.failpoints import failpoint
from outbox.settings import OutboxSettings
from outbox_agents.effects import EFFECT, Effects
from outbox_agents.state import AgentState, History, Pending, effect_message_id, messages_from
from outbox_agents.version import agent_version

log = logging.getLogger(__name__)
DepsT = TypeVar("DepsT")
OutputT = TypeVar("OutputT")

DEFAULT_RETRY = RetryPolicy(final=(InvalidMessage, ConfigurationError, UserError))
"""Model and tool errors are retried (3 attempts, backoff); a message the outbox refuses
and a misconfigured agent are not: retrying would make the same call again."""


@dataclass(frozen=True)
class Progress:
    """Where :meth:`DurableAgent.work` left the run it claimed."""

    run_id: uuid.UUID
    state: RunState
    reason: str | None
    model_requests: int
    """Model requests this worker made for the run (a resumed run makes none for the steps
    that committed before)."""
    output: Any = None
    """The agent's output (as JSON) when ``state`` is ``done``."""


class _Stop(Exception):
    def __init__(self, progress: Progress) -> None:
        self.progress = progress


class DurableAgent(Generic[DepsT, OutputT]):
    """Runs of *agent* as outboxkit runs of the workflow *name* (default: the agent's name).

    *effects*: the effect tools (:class:`outbox_agents.Effects`); the agent's own tools run inline,
    as read-only steps. The runs pin the agent's version (model, instructions, tool schemas;
    or *version*) and a worker with another version follows *on_version_change*. *retry*
    decides what a failing step does; *approval_expires* how long a requested approval
    lasts; *lease_seconds* the lease a worker holds (renewed as it goes).

    A round of read-only tool calls that took *checkpoint_tools_after* seconds or more is
    checkpointed on its own, while the model works on the next request; a faster one is
    checkpointed with the model's next response (0: every round on its own). Read-only tools
    are safe to run again, and a crash in between runs them again: for tools that answer in
    milliseconds that is cheaper than a transaction at every step.
    """

    def __init__(
        self,
        agent: Agent[DepsT, OutputT],
        *,
        name: str | None = None,
        effects: Effects | Sequence[Effects] = (),
        version: str | None = None,
        on_version_change: VersionPolicy = VersionPolicy.NEEDS_REVIEW,
        migrate: Migration | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        approval_expires: timedelta = timedelta(days=1),
        lease_seconds: float = 120.0,
        checkpoint_tools_after: float = 0.05,
        settings: OutboxSettings | None = None,
    ) -> None:
        workflow_name = name or agent.name
        if not workflow_name:
            raise ConfigurationError(
                "a durable agent needs a name (its runs' workflow): "
                "DurableAgent(agent, name=...) or Agent(..., name=...)")
        if lease_seconds <= 0:
            raise ConfigurationError(f"lease_seconds must be > 0, got {lease_seconds}")
        if checkpoint_tools_after < 0:
            raise ConfigurationError(
                f"checkpoint_tools_after must be >= 0 seconds, got {checkpoint_tools_after}")
        self.agent = agent
        self.effects: tuple[Effects, ...] = (
            (effects,) if isinstance(effects, Effects) else tuple(effects))
        pinned = agent_version(agent, self.effects)
        self.workflow = Workflow(
            name=workflow_name, version=version or pinned.version,
            prompt_version=pinned.prompt_version, tool_schema_version=pinned.tool_schema_version,
            on_version_change=on_version_change, migrate=migrate, retry=retry)
        self.approval_expires = approval_expires
        self.lease_seconds = lease_seconds
        self.checkpoint_tools_after = checkpoint_tools_after
        self.settings = settings
        self._registered: set[int] = set()
        output_type: Any = agent.output_type
        kinds = list(output_type) if isinstance(output_type, list | tuple) else [output_type]
        self._output_type: Any = [*kinds, DeferredToolRequests]

    @property
    def name(self) -> str:
        return self.workflow.name

    def __repr__(self) -> str:
        return f"DurableAgent({self.name!r}, version={self.workflow.version!r})"

    async def start(self, conn: AsyncConn, prompt: str, *, key: str) -> Run:
        """Queue a run of the agent on *prompt*, or return the run *key* already started;
        in the caller's transaction (never commits)."""
        if not isinstance(prompt, str) or not prompt:
            raise ConfigurationError("prompt must be a non-empty string")
        return await aio.start_run(
            conn, workflow=self.name, workflow_version=self.workflow.version,
            idempotency_key=key, checkpoint=AgentState(prompt=prompt).dump(),
            prompt_version=self.workflow.prompt_version,
            tool_schema_version=self.workflow.tool_schema_version, settings=self.settings)

    async def work(self, engine: AsyncEngine, *, worker: str,
                   deps: DepsT | None = None) -> Progress | None:
        """Claim one runnable run of this agent and drive it until it waits, needs a person,
        or ends; ``None`` when no run is runnable. Commits as it goes. (A worker does this
        for you: :meth:`outbox.App.register_agent` and ``outbox worker``.)"""
        if id(engine) not in self._registered:
            async with engine.begin() as conn:
                await aio.register(conn, self.workflow, settings=self.settings)
            self._registered.add(id(engine))
        async with engine.begin() as conn:
            job = await aio.claim(conn, worker=worker, lease_seconds=self.lease_seconds,
                                  workflows=[self.workflow], settings=self.settings)
        if job is None:
            return None
        return await self._turn(engine, job.run, job.lease, self.settings, deps)

    async def drive(self, engine: AsyncEngine, run: Run, lease: Lease, *,
                    settings: OutboxSettings | None, deps: DepsT | None) -> RunState:
        """One turn with *run*, claimed by a worker (:meth:`outbox.App.register_agent`): the
        state it leaves the run in. The worker's lease is set to this agent's
        *lease_seconds* first when the two differ by more than half."""
        progress = await self._turn(engine, run, lease, self.settings or settings, deps,
                                    align_lease=True)
        return progress.state

    async def _turn(self, engine: AsyncEngine, run: Run, lease: Lease,
                    settings: OutboxSettings | None, deps: DepsT | None, *,
                    align_lease: bool = False) -> Progress:
        # One connection for the whole turn, in autocommit: a step's save is one statement,
        # its own transaction, in one round trip (0.5 ms against 0.9 ms with BEGIN/COMMIT,
        # half the client CPU); a checkout per step cost more than the statement.
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            job: AsyncClaimedRun = AsyncClaimedRun(conn, run, lease, settings=settings)
            drive = _Drive(self, engine, conn, job, deps)
            if align_lease:
                await drive.align_lease()
            return await drive.run()

    async def output(self, conn: AsyncConn, run_id: uuid.UUID) -> OutputT:
        """The output of the finished run *run_id*, as the agent's output type."""
        run = await aio.get_run(conn, run_id, settings=self.settings)
        if run.state is not RunState.DONE:
            raise ConfigurationError(
                f"run {run_id} is {run.state.value}, not done: it has no output yet")
        value = AgentState.model_validate(run.checkpoint).output
        kind: Any = self.agent.output_type
        if not isinstance(kind, type):  # ToolOutput(...), a union list: the JSON as stored
            return cast(OutputT, value)
        adapter: TypeAdapter[OutputT] = TypeAdapter(kind)
        return adapter.validate_python(value)


def _calls_tools(response: ModelResponse) -> bool:
    return any(isinstance(part, ToolCallPart) for part in response.parts)


def _tool_results(request: ModelRequest) -> bool:
    return any(isinstance(part, ToolReturnPart | RetryPromptPart) for part in request.parts)


def _as_json(value: Any) -> Any:
    adapter: TypeAdapter[Any] = TypeAdapter(type(value))
    return adapter.dump_python(value, mode="json")


class _Drive(Generic[DepsT, OutputT]):
    """One worker's turn with one claimed run."""

    def __init__(self, durable: DurableAgent[DepsT, OutputT], engine: AsyncEngine,
                 conn: AsyncConnection, job: AsyncClaimedRun, deps: DepsT | None) -> None:
        self.durable = durable
        self.engine = engine
        self.conn = conn
        self.job = job
        self.deps = deps
        self.requests = 0
        self.tools_took = 0.0
        self.history = History([])
        self.messages: list[ModelMessage] = []
        """The run's message history as far as this turn got (committed or about to be)."""
        self.sent = False
        self.run_id = job.run.id

    def progress(self, state: RunState, reason: str | None, output: Any = None) -> Progress:
        return Progress(self.run_id, state, reason, self.requests, output)

    async def run(self) -> Progress:
        try:
            state = self.load()
            if state.logged:
                entries = await aio.read_log(self.conn, self.run_id, upto=state.logged,
                                             settings=self.job.settings)
                await self.conn.rollback()  # end the read's transaction before the writes
                self.messages = messages_from(entries)
                self.history = History(self.messages)
            if state.pending:
                state = await self.resume(state)
            return await self.drive(state)
        except _Stop as stop:
            return stop.progress
        except (LeaseLost, LeaseSpent) as exc:
            log.warning("run %s: %s; this worker stops", self.run_id, exc,
                        extra={"event": "agents.lease_lost", "run_id": str(self.run_id)})
            return self.progress(RunState.RUNNING, str(exc))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a tool's SystemExit too: the run's failure, not ours
            return await self.fail(exc)

    def load(self) -> AgentState:
        try:
            return AgentState.model_validate(self.job.run.checkpoint or {})
        except ValidationError as exc:
            raise ConfigurationError(
                f"run {self.run_id}'s checkpoint is not a durable agent's state (was it "
                f"started with DurableAgent.start?): {exc}") from exc

    async def fail(self, error: BaseException) -> Progress:
        log.warning("run %s failed a step: %r", self.run_id, error,
                    extra={"event": "agents.step_failed", "run_id": str(self.run_id)})
        try:
            async with self.engine.begin() as conn:
                handle = self.job.on(conn)
                outcome = await handle.handle_failure(
                    error, policy=self.durable.workflow.retry, step=self.job.run.step)
        except (LeaseLost, LeaseSpent) as exc:
            return self.progress(RunState.RUNNING, str(exc))
        return self.progress(outcome.state, f"{type(error).__name__}: {error}")

    # --- writes, each its own transaction --------------------------------------------

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[AsyncClaimedRun]:
        """A transaction and the run's handle in it; the handle is kept (its lease is the
        run's) only once the transaction committed."""
        async with self.engine.begin() as conn:
            handle = self.job.on(conn)
            yield handle
        self.job = handle
        self.history.committed(self.messages)

    @asynccontextmanager
    async def saving(self) -> AsyncIterator[AsyncClaimedRun]:
        """:meth:`writing` for one statement, which commits as it runs (the turn's
        autocommit connection)."""
        handle = self.job.on(self.conn)
        try:
            async with self.conn.begin():
                yield handle
        finally:
            # Each statement committed as it ran: the handle's lease is the run's even when
            # a later one failed (a renewal went through, then the save was refused).
            self.job = handle
        self.history.committed(self.messages)

    def log(self) -> dict[int, Any]:
        """The log entries the next save writes (see outbox_agents.state.History)."""
        return self.history.delta(self.messages)

    async def save(self, state: AgentState, *, step: str, response: bool = False) -> None:
        """Checkpoint *state* and the new messages; *response*: it records a model
        response."""
        async with self.saving() as handle:
            await self.keep_lease(handle)
            if response:  # the save commits as it runs: before it is before the commit
                failpoint("agent.before_response_commit")
            await handle.save_checkpoint(state.dump(), step=step, log=self.log())
        if response:
            failpoint("agent.after_response_commit")

    async def keep_lease(self, handle: AsyncClaimedRun) -> None:
        """Renew the lease once less than half of it is left (a model call may be slow)."""
        left = (handle.lease.expires_at - datetime.now(UTC)).total_seconds()
        if left < self.durable.lease_seconds / 2:
            await handle.renew(self.durable.lease_seconds)

    async def wait(self, handle: AsyncClaimedRun, state: AgentState, *, step: str,
                   reason: str, wake_at: datetime | None = None) -> Progress:
        await handle.transition(RunState.WAITING, step=step, reason=reason,
                                checkpoint=state.dump(), wake_at=wake_at)
        return self.progress(RunState.WAITING, reason)

    # --- the pending calls: approvals first, then effects one at a time -------------------

    async def settle(self, handle: AsyncClaimedRun, state: AgentState) -> Progress | None:
        """Resolve what the run waits for, in *handle*'s transaction; a Progress when the
        run must wait (or stop) again, None when every pending call has its result."""
        asks = [p for p in state.pending
                if p.kind == "approval" and p.call_id not in state.approved]
        unrequested = [p for p in asks if p.approval_id is None]
        if unrequested:
            return await self.request_approvals(handle, state, unrequested)
        for pending in asks:
            assert pending.approval_id is not None
            check = await handle.revalidate(pending.approval_id, scope=pending.scope or {})
            if not check.valid:
                return self.progress(check.state, check.reason)
            state.approved.append(pending.call_id)
        for pending in state.pending:
            if pending.kind != "effect" or pending.call_id in state.results:
                continue
            if not pending.emitted:
                return await self.send_effect(handle, state, pending)
            assert pending.message_id is not None
            found = await aio.confirmations(handle.conn, self.run_id, ids=[pending.message_id],
                                            settings=handle.settings)
            confirmation = found.get(str(pending.message_id))
            if confirmation is None:
                return await self.wait(
                    handle, state, step=f"waiting:{pending.tool}",
                    reason=f"waiting for the confirmation of message {pending.message_id} "
                           f"({pending.tool})")
            state.results[pending.call_id] = confirmation.evidence
        return None

    async def request_approvals(self, handle: AsyncClaimedRun, state: AgentState,
                                asks: list[Pending]) -> Progress:
        expiries = []
        for pending in asks:
            approval = await aio.request_approval(
                handle.conn, self.run_id, scope=pending.scope or {},
                expires_at=self.durable.approval_expires,
                reason=f"tool {pending.tool} needs approval", settings=handle.settings)
            pending.approval_id = approval.id
            expiries.append(approval.expires_at)
        tools = ", ".join(sorted({p.tool for p in asks}))
        # Woken by a grant, or at the expiry, when revalidation sends the run to a person.
        return await self.wait(handle, state, step=f"approval:{tools}",
                               reason=f"waiting for approval of {tools}", wake_at=min(expiries))

    async def send_effect(self, handle: AsyncClaimedRun, state: AgentState,
                          pending: Pending) -> Progress:
        assert pending.topic is not None
        assert pending.type is not None
        await handle.emit(Envelope(
            topic=pending.topic, type=pending.type, key=pending.key, payload=pending.payload,
            message_id=pending.message_id, workflow_version=self.durable.workflow.version))
        pending.emitted = True
        self.sent = True
        progress = await self.wait(
            handle, state, step=f"waiting:{pending.tool}",
            reason=f"sent {pending.tool} as message {pending.message_id}; waiting for its "
                   "confirmation")
        failpoint("agent.before_effect_commit")
        return progress

    async def resume(self, state: AgentState) -> AgentState:
        """Collect the results the run waited for, or wait again (raises _Stop)."""
        async with self.writing() as handle:
            waiting = await self.settle(handle, state)
            if waiting is None:
                await self.keep_lease(handle)
                state.pending = []
                await handle.save_checkpoint(state.dump(), step="resumed")
        if waiting is not None:
            if self.sent:
                failpoint("agent.after_effect_commit")
            raise _Stop(waiting)
        failpoint("agent.after_confirmation")
        return state

    async def deferred(self, state: AgentState, requests: DeferredToolRequests) -> Progress:
        """The run stopped on deferred calls: record them and send what comes first."""
        pending: list[Pending] = []
        for part in requests.approvals:
            pending.append(Pending(kind="approval", call_id=part.tool_call_id,
                                   tool=part.tool_name,
                                   scope={"tool": part.tool_name, "args": part.args_as_dict()}))
        for part in requests.calls:
            effect = requests.metadata.get(part.tool_call_id, {}).get(EFFECT)
            if effect is None:
                raise ConfigurationError(
                    f"tool {part.tool_name!r} deferred its call but is not an outboxkit "
                    "effect: register it with Effects.effect(...) so its call becomes an "
                    "outbox message")
            pending.append(Pending(kind="effect", call_id=part.tool_call_id,
                                   tool=part.tool_name,
                                   message_id=effect_message_id(self.run_id, part.tool_call_id),
                                   **effect))
        state = state.model_copy(update={"pending": pending, "results": {}, "approved": []})
        async with self.writing() as handle:
            # The model's response that asked for the calls goes to the log with them.
            await handle.save_checkpoint(state.dump(), log=self.log())
            progress = await self.settle(handle, state)
        if self.sent:
            failpoint("agent.after_effect_commit")
        assert progress is not None  # nothing was resolved yet
        return progress

    # --- the agent itself ----------------------------------------------------------------

    async def drive(self, state: AgentState) -> Progress:
        results = None
        if state.results or state.approved:
            results = DeferredToolResults(calls=dict(state.results),
                                          approvals=dict.fromkeys(state.approved, True))
        async with self.durable.agent.iter(
            None if self.messages else state.prompt,
            message_history=list(self.messages) or None,
            deferred_tool_results=results,
            output_type=self.durable._output_type,
            toolsets=self.durable.effects,
            deps=self.deps,  # type: ignore[arg-type] # None is the agent's own default
        ) as run:
            node: Any = run.next_node
            while not Agent.is_end_node(node):
                if Agent.is_model_request_node(node):
                    node, state = await self.model_step(run, node, state)
                else:
                    started = time.monotonic()
                    node = await run.next(node)
                    self.tools_took = time.monotonic() - started
            output: Any = node.data.output
        self.messages = run.all_messages()
        state = self.consumed(state.model_copy(update={"logged": len(self.messages)}))
        if isinstance(output, DeferredToolRequests):
            return await self.deferred(state, output)
        return await self.finish(state, output)

    async def model_step(self, run: Any, node: Any,
                         state: AgentState) -> tuple[Any, AgentState]:
        """One model request: the tool results it carries are saved while the model thinks
        (the response is not recorded before the results it answers: the save is awaited
        first), then the response."""
        messages = [*run.all_messages(), node.request]
        saving = None
        if (_tool_results(node.request) and len(messages) > state.logged
                and self.tools_took >= self.durable.checkpoint_tools_after):
            self.messages = messages
            state = self.consumed(state.model_copy(update={"logged": len(messages)}))
            saving = asyncio.ensure_future(self.save(state, step=f"tool-results:{len(messages)}"))
        else:
            await self.renew_if_needed()  # (a save renews the lease itself)
        try:
            node = await run.next(node)
        finally:
            if saving is not None:
                await saving
        self.requests += 1
        self.messages = run.all_messages()
        state = self.consumed(state.model_copy(update={"logged": len(self.messages)}))
        response = getattr(node, "model_response", None)
        if response is None or _calls_tools(response):
            await self.save(state, step=f"model-response:{len(self.messages)}", response=True)
        # else: an answer. pydantic-ai cannot resume from a history that ends with one (it
        # would ask the model again), so it commits with what it leads to: the move to done,
        # or the retry prompt of an answer refused.
        return node, state

    def consumed(self, state: AgentState) -> AgentState:
        """Once the agent went past the calls it resumed with, their results are history."""
        if not state.results and not state.approved:
            return state
        return state.model_copy(update={"results": {}, "approved": []})

    async def align_lease(self) -> None:
        """A worker claimed with its own lease: hold this agent's instead (a killed worker's
        run is then taken over after the agent's *lease_seconds*, as with :meth:`work`)."""
        left = (self.job.lease.expires_at - datetime.now(UTC)).total_seconds()
        if abs(left - self.durable.lease_seconds) > self.durable.lease_seconds / 2:
            async with self.saving() as handle:
                await handle.renew(self.durable.lease_seconds)

    async def renew_if_needed(self) -> None:
        left = (self.job.lease.expires_at - datetime.now(UTC)).total_seconds()
        if left >= self.durable.lease_seconds / 2:
            return
        async with self.saving() as handle:
            await handle.renew(self.durable.lease_seconds)

    async def finish(self, state: AgentState, output: Any) -> Progress:
        value = _as_json(output)
        state = state.model_copy(update={"output": value})
        async with self.writing() as handle:
            await handle.save_checkpoint(state.dump(), log=self.log())
            await handle.transition(RunState.DONE, step="done", reason="the agent answered",
                                    evidence={"output": value}, checkpoint=state.dump())
            failpoint("agent.before_response_commit")  # the answer commits with the move
        failpoint("agent.after_response_commit")
        return self.progress(RunState.DONE, None, value)
