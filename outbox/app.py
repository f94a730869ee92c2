"""Workflows registered as step functions: what ``outbox worker module:app`` runs.

::

    app = App()

    @app.workflow("supplier-order", version="1")
    def decide(job: ClaimedRun[Order]) -> None:
        order = job.checkpoint          # an Order, validated from the stored JSON
        job.emit(Envelope(...))
        job.transition("waiting", step="order-submitted", reason="...")

A step function takes one parameter, the claimed run's handle, annotated ``ClaimedRun[T]``
(``AsyncClaimedRun[T]`` for an ``async def``). *T* is the checkpoint's type: a pydantic
model, a dataclass, a ``TypedDict``, ``dict[str, Any]``... (anything pydantic validates;
``Any`` or a bare ``ClaimedRun`` keeps the stored JSON). The worker validates the stored
checkpoint into *T* before calling the function, and :meth:`App.start_run` serialises one.
Registration is per workflow *and* version: a run pinned to a registered version runs that
version's function; any other run of the workflow gets the newest version's
:class:`~outbox.runs.workflows.VersionPolicy`. The worker (:mod:`outbox.worker`) does the
rest: claim, transactions, retries, wake-ups.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import typing
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from outbox import aio
from outbox.db.execution import AsyncConn, Plan, SyncConn, run_plan, run_plan_async
from outbox.errors import CheckpointInvalid, ConfigurationError
from outbox.handle import ClaimedRun, RunHandle
from outbox.operations import Operations
from outbox.runs import children, lifecycle
from outbox.runs.children import child_key
from outbox.runs.lifecycle import Run
from outbox.runs.retry import RetryPolicy
from outbox.runs.signals import check_name, send_plan
from outbox.runs.workflows import Migration, VersionPolicy, Workflow
from outbox.settings import OutboxSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from outbox.runs.leases import Lease
    from outbox.runs.states import RunState

F = TypeVar("F", bound=Callable[..., Any])

_SHAPE = "(job: ClaimedRun[T]) for a def, (job: AsyncClaimedRun[T]) for an async def"


@runtime_checkable
class Driven(Protocol):
    """A workflow whose turn commits as it goes, in transactions of its own (a durable
    agent's :class:`outbox_agents.OutboxDurability`)."""

    @property
    def workflow(self) -> Workflow: ...

    async def drive(self, engine: AsyncEngine, run: Run, lease: Lease, *,
                    settings: OutboxSettings | None, deps: Any) -> RunState:
        """Drive the claimed *run* until it waits, ends or needs a person; the state it
        left the run in (``running``: its lease was lost)."""
        ...


agent_adapters: list[Callable[[Any], Driven | None]] = []
"""How :meth:`App.register_agent` finds the :class:`Driven` of an agent: outbox_agents adds
one when imported (this package never imports it)."""


def _driven(agent: Any) -> Driven:
    if isinstance(agent, Driven):
        return agent
    for adapter in agent_adapters:
        found = adapter(agent)
        if found is not None:
            return found
    raise ConfigurationError(
        f"{agent!r} is not a durable agent: build it with "
        "Agent(..., capabilities=[outbox_agents.OutboxDurability()])")


@dataclass(frozen=True, eq=False)
class Step:
    """One registered version of a workflow: its definition, its function and its checkpoint
    type (``Any``: the JSON as stored). *drives*: the function is a :class:`Driven`'s turn,
    called with the engine, the run and its lease, committing by itself."""

    workflow: Workflow
    fn: Callable[..., Any]
    is_async: bool
    checkpoint_type: Any
    drives: bool = False

    @property
    def name(self) -> str:
        """``workflow@version``, as logs and metrics name it."""
        return f"{self.workflow.name}@{self.workflow.version}"

    def load(self, run: Run) -> Any:
        """The run's stored checkpoint validated into the step's type."""
        if self.checkpoint_type is Any:
            return run.checkpoint
        try:
            return _adapter(self.checkpoint_type).validate_python(run.checkpoint)
        except ValidationError as exc:
            raise CheckpointInvalid(run.id, self.workflow.name, _shown(self.checkpoint_type),
                                    _first_error(exc)) from exc

    def dump(self, checkpoint: Any) -> Any:
        """*checkpoint* as the JSON value to store (checked against the step's type; ``None``
        too, unless the type accepts it: the worker would refuse the run)."""
        if self.checkpoint_type is Any:
            return checkpoint
        adapter = _adapter(self.checkpoint_type)
        try:
            # Validated first: a dict given for a model is checked, not stored blindly.
            return adapter.dump_python(adapter.validate_python(checkpoint), mode="json")
        except (ValidationError, PydanticSerializationError) as exc:
            detail = _first_error(exc) if isinstance(exc, ValidationError) else str(exc)
            raise CheckpointInvalid(None, self.workflow.name, _shown(self.checkpoint_type),
                                    detail) from exc


class App(Operations):
    """Registered workflows, the settings their runs are written with, and the database the
    worker connects to (``database_url``; default: ``OUTBOXKIT_DATABASE_URL``)."""

    def __init__(self, *, settings: OutboxSettings | None = None,
                 database_url: str | None = None) -> None:
        super().__init__(settings=settings)
        self.database_url = database_url
        self._steps: dict[tuple[str, str], Step] = {}
        self._by_fn: dict[Any, Step] = {}
        self._sorted: list[Step] | None = None  # _registered(), until the next registration

    def workflow(
        self,
        name: str,
        *,
        version: str,
        on_version_change: VersionPolicy | str = VersionPolicy.NEEDS_REVIEW,
        migrate: Migration | None = None,
        prompt_version: str | None = None,
        tool_schema_version: str | None = None,
        retry: RetryPolicy | None = None,
        step_retry: Mapping[str, RetryPolicy] | None = None,
        retired: bool = False,
        retired_reason: str | None = None,
        signals: Collection[str] | None = None,
    ) -> Callable[[F], F]:
        """Register the decorated function as version *version* of workflow *name*.

        The keywords are :class:`~outbox.runs.workflows.Workflow`'s. The function is
        returned unchanged (call it in tests with a handle of your own).
        """

        def register(fn: F) -> F:
            definition = Workflow(
                name=name, version=version, on_version_change=VersionPolicy(on_version_change),
                migrate=migrate, prompt_version=prompt_version,
                tool_schema_version=tool_schema_version, retry=retry or RetryPolicy(),
                step_retry=dict(step_retry or {}), retired=retired,
                retired_reason=retired_reason,
                signals=None if signals is None else frozenset(
                    check_name(n) for n in signals),
            )
            self._add(_step(definition, fn), fn)
            return fn

        return register

    def register_agent(self, agent: Any, *, deps: Any = None) -> None:
        """Run *agent* (a pydantic-ai agent built with ``capabilities=[OutboxDurability()]``)
        on this app's worker: its runs are claimed like any workflow's, and each turn drives
        the agent until the run waits, ends or needs a person, committing at every step
        boundary. *deps*: the agent's dependencies for runs started without their own. Start
        its runs with ``outbox_agents.start(...)``."""
        given, agent = agent, _driven(agent)
        own = getattr(agent, "settings", None)
        if own is not None and own.schema_name != self.settings.schema_name:
            raise ConfigurationError(
                f"agent {agent.workflow.name!r} writes its runs to schema {own.schema_name!r} "
                f"but this app's worker claims from {self.settings.schema_name!r}: give both "
                "the same OutboxSettings (or leave the agent's unset)")
        fn = functools.partial(agent.drive, deps=deps)
        # Keyed by what the caller holds (a capability is not hashable: its class compares).
        key = given if getattr(given, "__hash__", None) is not None else id(given)
        self._add(Step(agent.workflow, fn, True, Any, drives=True), key)

    def _add(self, step: Step, key: Any) -> None:
        name, version = step.workflow.name, step.workflow.version
        if (name, version) in self._steps:
            raise ConfigurationError(
                f"workflow {name!r} version {version!r} is registered twice (by "
                f"{_qualified(self._steps[name, version].fn)} and {_qualified(key)})")
        self._steps[name, version] = step
        self._by_fn[key] = step
        self._sorted = None

    @property
    def workflows(self) -> list[Workflow]:
        """Every registered version, the newest of each workflow last (what claims get)."""
        return [s.workflow for s in self._registered()]

    def _registered(self) -> list[Step]:
        """Every registered version's :class:`Step`, the newest of each workflow last."""
        # Sorted once per registration, not per claimed run (the worker asks for every step).
        if self._sorted is None:
            self._sorted = sorted(self._steps.values(), key=_order)
        return list(self._sorted)

    def _step_for(self, run: Run) -> Step:
        """The step function a claimed *run* runs (the worker's choice): the registered
        version its pins match (workflow, prompt and tool-schema versions, as the claim's
        check), else the newest version's (the claim applied that version's policy already)."""
        pins = {"workflow_version": run.workflow_version, "prompt_version": run.prompt_version,
                "tool_schema_version": run.tool_schema_version}
        versions = [s for s in self._registered() if s.workflow.name == run.workflow]
        for step in versions:
            if step.workflow.version_change(pins) is None:
                return step
        return versions[-1] if versions else self.step(run.workflow)

    def step(self, workflow: str | Callable[..., Any]) -> Step:
        """The registration of a step function, or the newest version of a workflow name."""
        if not isinstance(workflow, str):
            found = self._by_fn.get(workflow)
            if found is None:
                raise ConfigurationError(
                    f"{_qualified(workflow)} is not a registered workflow of this app: "
                    "decorate it with @app.workflow(name, version=...)")
            return found
        versions = [s for s in self._registered() if s.workflow.name == workflow]
        if not versions:
            known = sorted({name for name, _ in self._steps}) or ["none"]
            raise ConfigurationError(
                f"workflow {workflow!r} is not registered in this app (registered: "
                f"{', '.join(known)})")
        return versions[-1]

    def start_run(self, conn: SyncConn, workflow: str | Callable[..., Any], *,
                  idempotency_key: str, checkpoint: Any = None, notify: bool = True,
                  parent: RunHandle[Any, Any] | None = None) -> Run:
        """Queue a run of *workflow* (a registered step function, or a name: its newest
        version) with *checkpoint* serialised from its type; never commits.

        :func:`outbox.runs.lifecycle.start_run` with the registration's name and versions
        and this app's settings: the run wakes an idle worker when the caller commits.
        *parent*: the handle of the step starting it as a child (:mod:`outbox.runs.children`;
        the key is then the parent's). ``notify=False`` for a transaction that will be
        prepared (no NOTIFY; a worker finds the run by its fallback poll).
        """
        return run_plan(conn, self._start_plan(workflow, idempotency_key, checkpoint, notify,
                                               parent), self.settings)

    async def start_run_async(self, conn: AsyncConn, workflow: str | Callable[..., Any], *,
                              idempotency_key: str, checkpoint: Any = None,
                              notify: bool = True,
                              parent: RunHandle[Any, Any] | None = None) -> Run:
        """:meth:`start_run` on an ``AsyncConnection`` / ``AsyncSession``; never commits.
        ``notify=False`` for a transaction that will be prepared."""
        return await run_plan_async(conn, self._start_plan(
            workflow, idempotency_key, checkpoint, notify, parent), self.settings)

    def start_children(self, job: RunHandle[Any, Any], workflow: str | Callable[..., Any],
                       items: Mapping[str, Any], *, concurrency: int | None = None,
                       notify: bool = True) -> list[Run]:
        """Start one child run of *workflow* per ``key: checkpoint`` of *items*, in *job*'s
        transaction and one statement (never commits); return them in the order of *items*.

        As :meth:`start_run` with ``parent=job`` for each item (a key started already is
        that child, if its input is the same), and *concurrency*: at most that many of the
        parent's children unfinished and not held at once; the others are started held and
        each child that finishes releases the next (:mod:`outbox.runs.children`).
        """
        return run_plan(job.conn, self._start_many_plan(job, workflow, items, concurrency,
                                                        notify), self.settings)

    async def start_children_async(self, job: RunHandle[Any, Any],
                                   workflow: str | Callable[..., Any], items: Mapping[str, Any],
                                   *, concurrency: int | None = None,
                                   notify: bool = True) -> list[Run]:
        """:meth:`start_children` on an async handle; never commits."""
        return await run_plan_async(job.conn, self._start_many_plan(
            job, workflow, items, concurrency, notify), self.settings)

    def _start_many_plan(self, job: RunHandle[Any, Any], workflow: str | Callable[..., Any],
                         items: Mapping[str, Any], concurrency: int | None,
                         notify: bool) -> Plan[list[Run]]:
        step = _startable(self.step(workflow))
        if not isinstance(items, Mapping):
            raise ConfigurationError(
                f"items must map each child's key to its checkpoint, got {type(items).__name__}")
        for key in items:
            child_key(job.run.id, key)  # a clear error for an empty or non-text key
        dumped = [(key, step.dump(checkpoint)) for key, checkpoint in items.items()]
        return children.start_many_plan(job._held(), dumped, pins=_pins(step.workflow),
                                        concurrency=concurrency, settings=self.settings,
                                        notify=notify)

    def _start_plan(self, workflow: str | Callable[..., Any], key: str, checkpoint: Any,
                    notify: bool, parent: RunHandle[Any, Any] | None) -> Plan[Run]:
        step = _startable(self.step(workflow))
        if parent is None:
            return lifecycle.start_run_plan(
                checkpoint=step.dump(checkpoint), idempotency_key=key, settings=self.settings,
                notify=notify, **_pins(step.workflow))
        lease = parent._held()  # a step whose lease ended starts nothing (LeaseSpent)
        return children.start_plan(lease, lifecycle.start_run_plan(
            checkpoint=step.dump(checkpoint), idempotency_key=child_key(parent.run.id, key),
            settings=self.settings, notify=notify, parent_id=parent.run.id,
            **_pins(step.workflow)))

    def signal(self, conn: SyncConn, run_id: uuid.UUID, name: str, *, signal_id: str,
               payload: Any = None, sender: str, notify: bool = True) -> bool:
        """Send run *run_id* the signal *name* in the caller's transaction (never commits):
        kept until the run takes it (``job.receive(name)``), waking it now if it waits for
        *name*. True if recorded, False if *signal_id* was already (sent once, whatever the
        retries). Refused, nothing written: a finished run, a name its workflow (registered
        here with ``signals=``) does not declare, *signal_id* reused for another signal.
        ``notify=False`` for a transaction that will be prepared."""
        return run_plan(conn, self._signal_plan(run_id, name, payload, signal_id=signal_id,
                                                sender=sender, notify=notify), self.settings)

    async def signal_async(self, conn: AsyncConn, run_id: uuid.UUID, name: str, *,
                           signal_id: str, payload: Any = None, sender: str,
                           notify: bool = True) -> bool:
        """:meth:`signal` on an ``AsyncConnection`` / ``AsyncSession``; never commits."""
        return await run_plan_async(conn, self._signal_plan(
            run_id, name, payload, signal_id=signal_id, sender=sender, notify=notify),
            self.settings)

    def _signal_plan(self, run_id: uuid.UUID, name: str, payload: Any, *, signal_id: str,
                     sender: str, notify: bool) -> Plan[bool]:
        accepted = {(s.workflow.name, s.workflow.version): s.workflow.signals
                    for s in self._registered() if s.workflow.signals is not None}
        return send_plan(run_id, name, payload, signal_id=signal_id, sender=sender,
                         accepted=accepted, settings=self.settings, notify=notify)


def _startable(step: Step) -> Step:
    if step.drives:  # its runs start from the agent's own state
        raise ConfigurationError(
            f"workflow {step.workflow.name!r} is a registered agent: start its runs with "
            "the agent's start(conn, prompt, key=...)")
    return step


def _pins(workflow: Workflow) -> dict[str, Any]:
    return {"workflow": workflow.name, "workflow_version": workflow.version,
            "prompt_version": workflow.prompt_version,
            "tool_schema_version": workflow.tool_schema_version}


def _step(workflow: Workflow, fn: Callable[..., Any]) -> Step:
    """Read *fn*'s handle parameter: sync or async, and the checkpoint's type."""
    where = f"step function {_qualified(fn)} of workflow {workflow.name!r}"
    try:
        signature = inspect.signature(fn, eval_str=True)
    except NameError as exc:
        raise ConfigurationError(f"{where}: an annotation names something its module does not "
                                 f"define ({exc}); define the checkpoint type at module level"
                                 ) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{where} has no signature to read ({exc})") from exc
    params = list(signature.parameters.values())
    required = [p for p in params[1:] if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                            params[0].POSITIONAL_OR_KEYWORD) or required:
        raise ConfigurationError(f"{where} takes {signature}; a step function takes {_SHAPE}")
    is_async = inspect.iscoroutinefunction(fn)
    handle = aio.AsyncClaimedRun if is_async else ClaimedRun
    annotation = params[0].annotation
    if annotation is inspect.Parameter.empty:
        raise ConfigurationError(
            f"{where}: parameter {params[0].name!r} has no annotation; annotate it "
            f"{handle.__name__}[T], T being the checkpoint's type (e.g. a pydantic model)")
    origin = typing.get_origin(annotation) or annotation
    if origin is not handle:
        other = ClaimedRun if is_async else aio.AsyncClaimedRun
        hint = (f" ({'an async def' if is_async else 'a def'} gets {handle.__name__})"
                if origin is other else "")
        raise ConfigurationError(
            f"{where}: parameter {params[0].name!r} is annotated {_shown(annotation)}; "
            f"annotate it {handle.__name__}[T]{hint}")
    args = typing.get_args(annotation)
    checkpoint_type = args[0] if args else Any
    if checkpoint_type is not Any:
        try:
            _adapter(checkpoint_type)
        except Exception as exc:  # pydantic's schema errors have no common base to name
            raise ConfigurationError(
                f"{where}: the checkpoint type {_shown(checkpoint_type)} cannot be validated "
                f"from JSON ({exc})") from exc
    return Step(workflow, fn, is_async, checkpoint_type)


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(kind: Any) -> TypeAdapter[Any]:
    # Building an adapter compiles a validator: once per type, not per step.
    try:
        return _ADAPTERS[kind]
    except (KeyError, TypeError):
        adapter: TypeAdapter[Any] = TypeAdapter(kind)
        with contextlib.suppress(TypeError):  # an unhashable annotation: not cached
            _ADAPTERS[kind] = adapter
        return adapter


def _order(step: Step) -> tuple[str, tuple[tuple[int, str], ...]]:
    """Sort key: by workflow name, then version with numbers compared as numbers ("10" > "9")."""
    parts = re.split(r"(\d+)", step.workflow.version)
    return step.workflow.name, tuple((int(p), "") if p.isdigit() else (-1, p) for p in parts if p)


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "the value"
    return f"{where}: {first['msg']}" + (f" ({exc.error_count() - 1} more)"
                                         if exc.error_count() > 1 else "")


def _shown(annotation: Any) -> str:
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__qualname__
    return repr(annotation).replace("typing.", "")


def _qualified(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name
