"""outboxkit as a pydantic-ai durability capability (``capabilities=[OutboxDurability()]``).

Built on pydantic-ai's public durable-execution surface, beside ``DBOSDurability``,
``TemporalDurability`` and ``PrefectDurability``: the base routes the agent's model requests
and tool calls through :class:`outbox_agents.journal.JournalBackend`, and a worker's turn with a
run (:mod:`outbox_agents.runner`) runs the agent with the run's journal, fenced by the run's
lease. The agent's runs are outboxkit runs of the workflow named after the agent, pinned to
its version (model, instructions, tool schemas).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, cast

from pydantic_ai.agent import AbstractAgent, EventStreamHandler
from pydantic_ai.durable_exec import (
    JSON_CODEC,
    BaseDurabilityCapability,
    DurabilityEngineSpec,
    DurableOperationBackend,
    conversation_id_from_run_id,
)
from pydantic_ai.exceptions import UserError
from pydantic_ai.models import Model
from pydantic_ai.tools import AgentDepsT
from pydantic_ai.usage import UsageLimits
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.errors import ConfigurationError, InvalidMessage
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import Run
from outbox.runs.retry import RetryPolicy
from outbox.runs.states import RunState
from outbox.runs.workflows import Migration, VersionPolicy, Workflow
from outbox.settings import OutboxSettings
from outbox_agents import journal, runner
from outbox_agents.version import agent_version

DEFAULT_RETRY = RetryPolicy(final=(InvalidMessage, ConfigurationError, UserError))
"""Model and tool errors are retried (3 attempts, backoff); a message the outbox refuses
and a misconfigured agent are not: retrying would make the same call again."""


class OutboxDurability(BaseDurabilityCapability[AgentDepsT]):
    """Make an agent's runs durable outboxkit runs.

    Give it to the agent (``Agent(..., name="support", toolsets=[effects],
    capabilities=[OutboxDurability()])``), start runs with :func:`outbox_agents.start`, and run
    them on a worker (:meth:`outbox.App.register_agent`). Every model response is journaled in
    the run's log before the agent goes on, and the calls of :class:`outbox_agents.Effects`
    tools become outbox messages committed with the run's move to ``waiting``.

    Options (all optional):

    * *lease_seconds* (30): the lease a worker holds on a run, renewed every third of it
      while the agent runs (a slow model call or tool included); a killed worker's run is
      taken over once it runs out;
    * *retry* (:data:`DEFAULT_RETRY`): what a failing step does (model and tool errors are
      retried 3 times with backoff, then the run fails);
    * *approval_expires* (1 day): how long a requested approval can be granted;
    * *checkpoint_tools_after* (0.05 s): a tool that took this long or longer has its result
      written at once; a faster one's is written with the next model response (a crash in
      between runs it again: read-only tools are safe to run again);
    * *usage_limits*: pydantic-ai's limits, counted over the whole run, the responses of
      earlier turns included;
    * *rebuild_deps*: ``fn(stored) -> deps``, called at every turn with the JSON the run was
      started with (``start(..., deps=...)``); by default that JSON is validated as the
      agent's ``deps_type``. For dependencies that are not data (a client, a pool), store
      what identifies them and rebuild them here;
    * *version*, *on_version_change*, *migrate*: the version the runs pin (default: a hash
      of the model, instructions and tool schemas) and what a worker with another version
      does (default: the run goes to ``needs-human`` for review);
    * *settings*: the :class:`outbox.OutboxSettings` (schema) the runs live in;
    * *name*, *models*, *event_stream_handler*: as for pydantic-ai's other durability
      capabilities (the workflow's name defaults to the agent's).
    """

    engine_spec = DurabilityEngineSpec(
        engine_name="outboxkit",
        durable_unit_noun="step",
        durable_container_noun="run",
        codec=JSON_CODEC,  # the journal is JSON in PostgreSQL
        wrapped_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        toolset_lifecycles={"function": "enter-always", "mcp": "enter-in-durable-unit",
                            "dynamic": "enter-never"},
        journal_discovery=True,
        sequential_tools_in_durable_context=False,  # keys carry the tool call id
    )

    def __init__(
        self,
        *,
        name: str | None = None,
        models: Mapping[str, Model] | None = None,
        event_stream_handler: EventStreamHandler[AgentDepsT] | None = None,
        lease_seconds: float = 30.0,
        retry: RetryPolicy = DEFAULT_RETRY,
        approval_expires: timedelta = timedelta(days=1),
        checkpoint_tools_after: float = 0.05,
        usage_limits: UsageLimits | None = None,
        rebuild_deps: Callable[[Any], Any] | None = None,
        version: str | None = None,
        on_version_change: VersionPolicy = VersionPolicy.NEEDS_REVIEW,
        migrate: Migration | None = None,
        settings: OutboxSettings | None = None,
    ) -> None:
        if lease_seconds <= 0:
            raise ConfigurationError(f"lease_seconds must be > 0, got {lease_seconds}")
        if checkpoint_tools_after < 0:
            raise ConfigurationError(
                f"checkpoint_tools_after must be >= 0 seconds, got {checkpoint_tools_after}")
        if approval_expires <= timedelta(0):
            raise ConfigurationError(f"approval_expires must be > 0, got {approval_expires}")
        super().__init__(models=models, event_stream_handler=event_stream_handler, name=name)
        self.lease_seconds = lease_seconds
        self.retry = retry
        self.approval_expires = approval_expires
        self.checkpoint_tools_after = checkpoint_tools_after
        self.usage_limits = usage_limits
        self.rebuild_deps = rebuild_deps
        self.settings = settings
        self._version = (version, on_version_change, migrate)
        self._workflow: Workflow | None = None

    # --- pydantic-ai's durability hooks ---------------------------------------------------

    @property
    def in_durable_context(self) -> bool:
        turn = journal.CURRENT.get()
        return turn is not None and getattr(turn, "durability", None) is self

    def get_durable_operation_backend(self) -> DurableOperationBackend[Any]:
        return journal.JournalBackend(agent_name=self.name, default_model_id=self.default_model_id)

    def get_default_run_id(self) -> str | None:
        turn = journal.CURRENT.get()
        if turn is None or getattr(turn, "durability", None) is not self:
            return None
        return str(cast(Any, turn).run_id)

    def get_default_conversation_id(self, run_id: str) -> str | None:
        return conversation_id_from_run_id(run_id) if self.in_durable_context else None

    async def get_run_start_time(self, run_id: str) -> datetime | None:
        turn = journal.CURRENT.get()
        if turn is None or getattr(turn, "durability", None) is not self:
            return None
        return cast(datetime, cast(Any, turn).started_at)

    # --- the runs -------------------------------------------------------------------------

    @property
    def bound_agent(self) -> AbstractAgent[AgentDepsT, Any]:
        agent = self.agent
        if agent is None:
            raise ConfigurationError(
                "this OutboxDurability is not bound to an agent: give it to one "
                "(Agent(..., capabilities=[OutboxDurability()])) and use "
                "OutboxDurability.from_agent(agent)")
        return agent

    @property
    def workflow(self) -> Workflow:
        """The workflow (name and pinned version) of the agent's runs."""
        if self._workflow is None:
            agent = self.bound_agent
            version, on_change, migrate = self._version
            runner.run_output_type(agent)  # refused here, at registration, not at a turn
            pinned = agent_version(agent)  # the Effects are among the agent's toolsets
            self._workflow = Workflow(
                name=self.name, version=version or pinned.version,
                prompt_version=pinned.prompt_version,
                tool_schema_version=pinned.tool_schema_version,
                on_version_change=on_change, migrate=migrate, retry=self.retry)
        return self._workflow

    async def drive(self, engine: AsyncEngine, run: Run, lease: Lease, *,
                    settings: OutboxSettings | None, deps: Any) -> RunState:
        """One turn with *run*, claimed by a worker (:meth:`outbox.App.register_agent`): the
        state it leaves the run in (``running``: the lease was lost)."""
        progress = await runner.turn(self, engine, run, lease, settings=self.settings or settings,
                                     deps=deps, align_lease=True)
        return progress.state


def durability_of(agent: AbstractAgent[Any, Any]) -> OutboxDurability[Any]:
    """The bound :class:`OutboxDurability` of *agent*, or a clear error."""
    found = OutboxDurability.from_agent(agent)
    if found is None:
        raise ConfigurationError(
            f"agent {agent.name!r} has no OutboxDurability capability: build it with "
            "Agent(..., capabilities=[OutboxDurability()])")
    return found


def _adapt(agent: Any) -> OutboxDurability[Any] | None:
    """outbox.App.register_agent's lookup: an agent's bound capability."""
    return durability_of(agent) if isinstance(agent, AbstractAgent) else None
