"""A worker's turn with one claimed run of a durable agent.

The turn first settles what the run waits for (approvals to request or spend, effect messages
to send, confirmations to collect), then runs the agent from its prompt with the run's journal
(:mod:`outbox_agents.journal`): recorded units return their results, new ones run and are
journaled. The agent ends with its answer (the run is ``done``) or with effect calls it deferred
(they are recorded, and sent in the transaction that moves the run to ``waiting``). Every write
carries the lease: a worker whose lease was taken over writes nothing more (``LeaseLost``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from pydantic import TypeAdapter, ValidationError
from pydantic_ai import DeferredToolRequests
from pydantic_ai.durable_exec import replay_scope
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox import aio
from outbox.aio import AsyncClaimedRun
from outbox.db.execution import run_plan_async
from outbox.errors import ApprovalInvalid, ConfigurationError, LeaseLost, LeaseSpent
from outbox.messages.envelope import Envelope
from outbox.runs.approvals import call_digest
from outbox.runs.approvals import list_plan as approvals_plan
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import Run
from outbox.runs.states import RunState
from outbox.runtime.failpoints import failpoint
from outbox.settings import OutboxSettings
from outbox_agents import journal
from outbox_agents.effects import EFFECT
from outbox_agents.state import AgentState, Call, effect_message_id

log = logging.getLogger(__name__)


class Durability(Protocol):
    """What a turn reads of the agent's capability (outbox_agents.capability)."""

    lease_seconds: float
    retry: Any
    approval_expires: timedelta
    checkpoint_tools_after: float
    usage_limits: Any
    rebuild_deps: Callable[[Any], Any] | None

    @property
    def bound_agent(self) -> Any: ...

    @property
    def workflow(self) -> Any: ...


@dataclass(frozen=True)
class Progress:
    """Where a worker's turn left the run it claimed."""

    run_id: uuid.UUID
    state: RunState
    reason: str | None
    model_requests: int
    """Model requests this turn sent (the journal answers those of earlier turns)."""
    output: Any = None
    """The agent's output (as JSON) when ``state`` is ``done``."""


class _Stop(Exception):
    def __init__(self, progress: Progress) -> None:
        self.progress = progress


async def turn(durability: Durability, engine: AsyncEngine, run: Run, lease: Lease,
               *, settings: OutboxSettings | None, deps: Any,
               align_lease: bool = False) -> Progress:
    # One connection for the whole turn, in autocommit: a journal write is one statement,
    # its own transaction, in one round trip.
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        job = AsyncClaimedRun(conn, run, lease, settings=settings)
        return await _Turn(durability, engine, conn, job, deps).run(align_lease)


class _Turn:
    def __init__(self, durability: Durability, engine: AsyncEngine,
                 conn: AsyncConnection, job: AsyncClaimedRun, deps: Any) -> None:
        self.durability = durability
        self.engine = engine
        self.conn = conn
        self.job = job
        self.deps = deps
        self.run_id = job.run.id
        self.started_at = job.run.created_at
        self.journal = journal.Journal([])
        self.state = AgentState(prompt="")
        self.results: dict[str, Any] = {}
        self.requests = 0
        self.sent = False
        self._writes = asyncio.Lock()

    def progress(self, state: RunState, reason: str | None, output: Any = None) -> Progress:
        return Progress(self.run_id, state, reason, self.requests, output)

    async def run(self, align_lease: bool) -> Progress:
        try:
            if align_lease:
                await self.align_lease()
            self.state = self.load()
            if self.state.logged:
                entries = await aio.read_log(self.conn, self.run_id, upto=self.state.logged,
                                             settings=self.job.settings)
                await self.conn.rollback()  # end the read's transaction before the writes
                self.journal = journal.Journal(entries)
            if self.state.calls:
                await self.settle()
            return await self.drive()
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
                f"started with outbox_agents.start?): {exc}") from exc

    async def fail(self, error: BaseException) -> Progress:
        log.warning("run %s failed a step: %r", self.run_id, error,
                    extra={"event": "agents.step_failed", "run_id": str(self.run_id)})
        try:
            async with self.engine.begin() as conn:
                outcome = await self.job.on(conn).handle_failure(
                    error, policy=self.durability.retry, step=self.job.run.step)
        except (LeaseLost, LeaseSpent) as exc:
            return self.progress(RunState.RUNNING, str(exc))
        return self.progress(outcome.state, f"{type(error).__name__}: {error}")

    # --- writes ---------------------------------------------------------------------------

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[AsyncClaimedRun]:
        """A transaction and the run's handle in it; the handle is kept (its lease is the
        run's) only once the transaction committed."""
        async with self.engine.begin() as conn:
            handle = self.job.on(conn)
            yield handle
        self.job = handle

    async def save(self, handle: AsyncClaimedRun, step: str) -> None:
        """Checkpoint the state with the journal entries not written yet, in *handle*'s
        transaction (or as one statement, on the turn's autocommit connection)."""
        batch, count = self.journal.taken()
        self.state.logged = count
        await self.keep_lease(handle)
        await handle.save_checkpoint(self.state.dump(), step=step, log=batch)
        self.journal.written(count)

    async def record(self, key: str, payload: Any, *, response: bool, took: float) -> None:
        self.journal.add(key, payload)
        if response:
            self.requests += 1
            if not _calls_tools(payload):
                # An answer commits with what it leads to: the move to done, or the next
                # request (its retry prompt), which writes it first.
                return
        elif took < self.durability.checkpoint_tools_after:
            return
        async with self._writes:
            if not self.journal.unwritten:
                return  # a concurrent write took it
            handle = self.job.on(self.conn)
            try:
                if response:  # one statement: before it runs is before its commit
                    failpoint("agent.before_response_commit")
                await self.save(handle, f"model-response:{self.requests}" if response
                                else f"tool-results:{self.journal.logged}")
            finally:
                self.job = handle
        if response:
            failpoint("agent.after_response_commit")

    async def keep_lease(self, handle: AsyncClaimedRun) -> None:
        """Renew the lease once less than half of it is left (a model call may be slow)."""
        left = (handle.lease.expires_at - datetime.now(UTC)).total_seconds()
        if left < self.durability.lease_seconds / 2:
            await handle.renew(self.durability.lease_seconds)

    async def before_request(self) -> None:
        async with self._writes:
            handle = self.job.on(self.conn)
            try:
                await self.keep_lease(handle)
            finally:
                self.job = handle

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Renew the lease every third of it while the agent runs: a model call or a tool
        may outlast it, and another worker would then take the run over and ask again."""
        every = self.durability.lease_seconds / 3
        while True:
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except TimeoutError:
                pass
            async with self._writes:  # the turn's connection runs one statement at a time
                if stop.is_set():
                    return
                handle = self.job.on(self.conn)
                try:
                    await handle.renew(self.durability.lease_seconds)
                except (LeaseLost, LeaseSpent):
                    return  # the next write finds out and stops the turn
                finally:
                    self.job = handle

    async def align_lease(self) -> None:
        """A worker claimed with its own lease: hold the agent's instead."""
        left = (self.job.lease.expires_at - datetime.now(UTC)).total_seconds()
        lease_seconds = self.durability.lease_seconds
        if abs(left - lease_seconds) > lease_seconds / 2:
            handle = self.job.on(self.conn)
            try:
                await handle.renew(lease_seconds)
            finally:
                self.job = handle

    async def wait(self, handle: AsyncClaimedRun, *, step: str, reason: str,
                   wake_at: datetime | None = None) -> Progress:
        """Move the run to ``waiting``, with the journal entries not written yet."""
        batch, count = self.journal.taken()
        self.state.logged = count
        await handle.transition(RunState.WAITING, step=step, reason=reason,
                                checkpoint=self.state.dump(), wake_at=wake_at, log=batch)
        self.journal.written(count)
        return self.progress(RunState.WAITING, reason)

    # --- the effect calls: approvals, messages, confirmations -----------------------------

    def result_of(self, call_id: str) -> Any:
        return self.results.get(call_id, journal.MISSING)

    async def settle(self) -> None:
        """Resolve what the run waits for; raises _Stop when it must wait (or stop) again."""
        try:
            async with self.writing() as handle:
                waiting = await self.settled(handle)
        except ApprovalInvalid as refused:  # spent already, other arguments: a person decides
            raise _Stop(await self.refused(refused)) from None
        if waiting is not None:
            if self.sent:
                failpoint("agent.after_effect_commit")
            raise _Stop(waiting)
        failpoint("agent.after_confirmation")

    async def settled(self, handle: AsyncClaimedRun) -> Progress | None:
        """In *handle*'s transaction: a Progress when the run must wait again, None when
        every effect call has its confirmation (then in :attr:`results`).

        What can go out goes out now: a call whose approval is pending holds back only its
        own key's later calls, not the other effects of the response."""
        calls = self.state.calls
        for call in calls:
            if call.approval and call.approval_id is None:
                await self.request_approval(handle, call)
        sent = [c for c in calls if c.sent]
        found = await aio.confirmations(handle.conn, self.run_id,
                                        ids=[c.message_id for c in sent],
                                        settings=handle.settings) if sent else {}
        approvals = await self.approvals(handle, calls)
        # One message per key in flight: the next of a key goes after its confirmation.
        busy = {_lane(c) for c in sent if str(c.message_id) not in found}
        batch: list[Call] = []
        held: list[Call] = []
        for call in calls:
            if call.sent or _lane(call) in busy:
                continue
            busy.add(_lane(call))
            if call.approval:
                approval = approvals[call.approval_id]
                if _pending(approval):
                    held.append(call)
                    continue
                # Granted (still covering the call?), or expired or revoked: revalidation
                # says so, and sends the run to a person when it is not valid.
                stopped = await self.revalidated(handle, call)
                if stopped is not None:
                    return stopped
            batch.append(call)
        if batch:
            await self.send(handle, batch)
        unconfirmed = [c for c in calls if c.sent and str(c.message_id) not in found]
        if not unconfirmed and not held:
            self.results = {c.call_id: found[str(c.message_id)].evidence for c in calls}
            return None
        progress = await self.wait(
            handle, step=_step(batch, held, unconfirmed),
            reason=_reason(batch, held, unconfirmed),
            wake_at=min((approvals[c.approval_id].expires_at for c in held), default=None))
        if batch:
            failpoint("agent.before_effect_commit")
        return progress

    async def refused(self, refused: ApprovalInvalid) -> Progress:
        """An approval could not be spent: the run goes to a person, nothing was sent."""
        reason = str(refused)
        async with self.writing() as handle:
            await handle.transition(RunState.NEEDS_HUMAN, reason=reason,
                                    evidence={"approval_id": str(refused.approval_id)})
        return self.progress(RunState.NEEDS_HUMAN, reason)

    async def request_approval(self, handle: AsyncClaimedRun, call: Call) -> None:
        approval = await aio.request_approval(
            handle.conn, self.run_id, scope={"tool": call.tool, "args": call.args},
            digest=call.digest, expires_at=self.durability.approval_expires,
            reason=f"tool {call.tool} needs approval", settings=handle.settings)
        call.approval_id = approval.id

    async def approvals(self, handle: AsyncClaimedRun, calls: list[Call]) -> dict[Any, Any]:
        """The run's approvals by id, when a call not sent yet has one."""
        if not any(c.approval and not c.sent for c in calls):
            return {}
        found = await run_plan_async(handle.conn, approvals_plan(self.run_id, False, 1000),
                                     handle.settings)
        return {a.id: a for a in found}

    async def revalidated(self, handle: AsyncClaimedRun, call: Call) -> Progress | None:
        """None when *call*'s approval is granted and valid; otherwise the run was moved
        (``waiting`` while it is pending, ``needs-human`` when it expired or was revoked)."""
        assert call.approval_id is not None
        check = await handle.revalidate(call.approval_id,
                                        scope={"tool": call.tool, "args": call.args})
        return None if check.valid else self.progress(check.state, check.reason)

    async def send(self, handle: AsyncClaimedRun, calls: list[Call]) -> None:
        """Send *calls*' messages, spending their approvals, in *handle*'s transaction."""
        for call in calls:
            if call.approval:
                assert call.approval_id is not None
                assert call.digest is not None
                await handle.spend_approval(call.approval_id, digest=call.digest,
                                            message_id=call.message_id)
            await handle.emit(Envelope(
                topic=call.topic, type=call.type, key=call.key, payload=call.payload,
                message_id=call.message_id,
                workflow_version=self.durability.workflow.version))
            call.sent = True
        self.sent = True

    async def deferred(self, requests: DeferredToolRequests) -> Progress:
        """The agent stopped on deferred calls: record them and send what comes first."""
        if requests.approvals:
            names = ", ".join(sorted({p.tool_name for p in requests.approvals}))
            raise ConfigurationError(
                f"tool(s) {names} use pydantic-ai's requires_approval: in a durable run an "
                "approval is outboxkit's, bound to the call's arguments and spent with its "
                "message: make the tool an effect with Effects.effect(requires_approval=True)")
        for part in requests.calls:
            effect = requests.metadata.get(part.tool_call_id, {}).get(EFFECT)
            if effect is None:
                raise ConfigurationError(
                    f"tool {part.tool_name!r} deferred its call but is not an outboxkit "
                    "effect: register it with Effects.effect(...) so its call becomes an "
                    "outbox message")
            args = effect["args"]
            call_id = effect.get("call") or part.tool_call_id
            self.state.calls.append(Call(
                call_id=call_id, tool=part.tool_name,
                message_id=effect_message_id(self.run_id, call_id),
                topic=effect["topic"], type=effect["type"], key=effect["key"],
                payload=effect["payload"], args=args, approval=effect["approval"],
                digest=call_digest(part.tool_name, args) if effect["approval"] else None))
        async with self.writing() as handle:
            progress = await self.settled(handle)
        if self.sent:
            failpoint("agent.after_effect_commit")
        assert progress is not None  # nothing was sent yet: the run waits
        return progress

    # --- the agent ------------------------------------------------------------------------

    def agent_deps(self) -> Any:
        stored = self.state.deps
        rebuild = self.durability.rebuild_deps
        if rebuild is not None:
            return rebuild(stored)
        if stored is None:
            return self.deps
        kind = self.durability.bound_agent.deps_type
        adapter: TypeAdapter[Any] = TypeAdapter(kind)
        return adapter.validate_python(stored)

    async def drive(self) -> Progress:
        agent = self.durability.bound_agent
        token = journal.CURRENT.set(self)
        stop = asyncio.Event()
        beat = asyncio.create_task(self.heartbeat(stop))
        try:
            with replay_scope():
                result: Any = await agent.run(
                    self.state.prompt, output_type=run_output_type(agent),
                    message_history=_history(self.state.history),
                    deps=self.agent_deps(), usage_limits=self.durability.usage_limits)
        finally:
            stop.set()
            await beat
            journal.CURRENT.reset(token)
        output: Any = result.output
        if isinstance(output, DeferredToolRequests):
            return await self.deferred(output)
        return await self.finish(output)

    async def finish(self, output: Any) -> Progress:
        value = _as_json(output)
        self.state.output = value
        self.state.calls = []
        batch, count = self.journal.taken()
        self.state.logged = count
        # The answer and the move to done: one statement, which commits as it runs on the
        # turn's autocommit connection (before it is before the commit).
        failpoint("agent.before_response_commit")
        handle = self.job.on(self.conn)
        try:
            await handle.transition(RunState.DONE, step="done", reason="the agent answered",
                                    evidence={"output": value}, checkpoint=self.state.dump(),
                                    log=batch)
        finally:
            self.job = handle
        failpoint("agent.after_response_commit")
        return self.progress(RunState.DONE, None, value)


def _as_json(value: Any) -> Any:
    adapter: TypeAdapter[Any] = TypeAdapter(type(value))
    return adapter.dump_python(value, mode="json")


def run_output_type(agent: Any) -> Any:
    """The output type a turn runs the agent with: the agent's own, and DeferredToolRequests,
    so that a turn ends when effect calls are deferred. None (the agent's as is) when it
    already has it; an agent with output validators must (pydantic-ai refuses another output
    type for a run then)."""
    output_type: Any = agent.output_type
    kinds = list(output_type) if isinstance(output_type, list | tuple) else [output_type]
    if DeferredToolRequests in kinds:
        return None
    if getattr(agent, "_output_validators", None):
        raise ConfigurationError(
            f"agent {agent.name!r} has output validators, so a durable run cannot add "
            "DeferredToolRequests to its output type: list it yourself, "
            "Agent(..., output_type=[YourOutput, DeferredToolRequests])")
    return [*kinds, DeferredToolRequests]


def _history(stored: list[Any] | None) -> list[ModelMessage] | None:
    return ModelMessagesTypeAdapter.validate_python(stored) if stored else None


def _pending(approval: Any) -> bool:
    """Neither granted nor revoked, and not expired yet (revalidation decides the others)."""
    return (approval.granted_at is None and approval.revoked_at is None
            and approval.expires_at > datetime.now(UTC))


def _tools(calls: list[Call]) -> str:
    return ", ".join(sorted({c.tool for c in calls}))


def _step(batch: list[Call], held: list[Call], unconfirmed: list[Call]) -> str:
    if batch or not held:
        return f"waiting:{_tools(batch or unconfirmed)}"
    return f"approval:{_tools(held)}"


def _reason(batch: list[Call], held: list[Call], unconfirmed: list[Call]) -> str:
    parts = []
    if batch:
        parts.append("sent " + ", ".join(f"{c.tool} as message {c.message_id}" for c in batch))
    if held:
        parts.append(f"waiting for approval of {_tools(held)}")
    if unconfirmed:  # the batch just sent is among them
        parts.append(f"waiting for the confirmation of {len(unconfirmed)} message(s) "
                     f"({_tools(unconfirmed)})")
    return "; ".join(parts)


def _lane(call: Call) -> str:
    """The ordering lane of a call's message: its key (a message without one has its own)."""
    return f"key:{call.key}" if call.key is not None else f"call:{call.call_id}"


def _calls_tools(response: Any) -> bool:
    return any(part.get("part_kind") == "tool-call" for part in response.get("parts", ()))
