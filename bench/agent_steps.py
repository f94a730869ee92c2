"""What durability costs a pydantic-ai agent step: ``agents.step_overhead_ms``.

One scripted model (pydantic-ai's ``FunctionModel``, no network): N model responses, each
but the last calling a cheap read-only tool, the last answering text. Two agents share it:

* bare: the agent without durability, ``agent.run`` in process, no database;
* durable: the same agent with ``capabilities=[OutboxDurability()]``,
  ``outbox_agents.start`` (its own transaction) and ``outbox_agents.work`` (one turn) on a
  real PostgreSQL (a database of its own, created and dropped here), the async path, which
  claims the run, journals every model response before the agent goes on (one fenced
  statement: the checkpoint and the new journal entries; a fast tool's result rides along
  with the next response) and finishes the run.

Rounds alternate the two (order alternating too, so drift in the machine's load favours
neither); each round takes the median run of each, at two run lengths (2 steps and N). The
durable run's extra time grows by the per-step overhead with each step; what is left at zero
steps is the per-run overhead (start, claim, the move to done). Both are medians over
rounds; goals: <= 2 ms a step, <= 5 ms a run. The client's CPU per step (process_time) is
printed beside them, then where a durable run's time goes (one instrumented round: the
journal writes, the checkpoint's round trip, pydantic-ai's JSON codec, pydantic-ai itself)
and a cProfile of one round (by cumulative and by own time).

The server's durability settings are left as they are (this is also run on the shared test
server); the suite makes its own server durable in a full run.

    python bench/agent_steps.py --database-url postgresql://postgres@host/postgres \\
        [--quick] [--steps 10] [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from durable import show  # bench/durable.py (this folder is on sys.path)
from figures import Figure, fmt
from figures import print_table as print_figures
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import outbox_agents
from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate
from outbox.runs.states import RunState
from outbox_agents import OutboxDurability

GOAL_MS = 2.0
RUN_GOAL_MS = 5.0
SHORT = 2
"""Model steps of the short run: one tool round and the answer."""
Breakdown = dict[str, tuple[float, float]]  # part -> (ms, calls) per durable run


def lookup_order(order_id: str) -> dict[str, str]:
    """Look an order up (read-only)."""
    return {"order_id": order_id, "item": "widget", "status": "shipped"}


def scripted_agents(steps: int) -> tuple[Agent[None, str], Agent[None, str]]:
    """(bare, durable): the same agent on the same model, without and with the capability;
    the model answers with a tool call *steps* - 1 times, then with text."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked = sum(isinstance(m, ModelResponse) for m in messages)
        if asked + 1 < steps:
            return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": f"A{asked}"})])
        return ModelResponse(parts=[TextPart(f"looked up {asked} orders")])

    function_model = FunctionModel(model)
    name = f"bench_steps_{steps}"
    bare: Agent[None, str] = Agent(function_model, name=name, output_type=str,
                                   instructions="answer about orders", tools=[lookup_order])
    durable: Agent[None, str] = Agent(function_model, name=name, output_type=str,
                                      instructions="answer about orders", tools=[lookup_order],
                                      capabilities=[OutboxDurability()])
    return bare, durable


class Bench:
    def __init__(self, engine: AsyncEngine, steps: int) -> None:
        self.engine = engine
        self.steps = steps
        self.agent, self.durable = scripted_agents(steps)

    async def bare(self) -> None:
        result = await self.agent.run("where are my orders?")
        assert result.output.startswith("looked up"), result.output

    async def durable_run(self) -> None:
        async with self.engine.begin() as conn:
            await outbox_agents.start(conn, self.durable, "where are my orders?",
                                      key=uuid.uuid4().hex)
        progress = await outbox_agents.work(self.engine, self.durable, worker="bench")
        assert progress is not None
        assert progress.state is RunState.DONE, progress
        assert progress.model_requests == self.steps, progress


# --- where the time goes -------------------------------------------------------------------


@contextlib.contextmanager
def instrumented(spent: dict[str, float], calls: dict[str, int]) -> Iterator[None]:
    """Time (wall) the parts of a durable step, by wrapping them for the duration.

    Wrapping costs a few microseconds a call; the timed rounds run without it.
    """
    from pydantic_ai.durable_exec import _codec  # noqa: PLC0415
    from pydantic_ai.run import AgentRun  # noqa: PLC0415

    from outbox import aio  # noqa: PLC0415
    from outbox_agents import runner, state  # noqa: PLC0415

    def sync_timer(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
                calls[name] = calls.get(name, 0) + 1

        return wrapper

    def async_timer(name: str, fn: Any) -> Any:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
                calls[name] = calls.get(name, 0) + 1

        return wrapper

    codec = type(_codec.JSON_CODEC)
    patches: list[tuple[Any, str, Any, Any]] = [
        (codec, "dump", sync_timer, "JSON codec dump (TypeAdapter)"),
        (codec, "load", sync_timer, "JSON codec load (TypeAdapter)"),
        (state.AgentState, "dump", sync_timer, "checkpoint model_dump (dump)"),
        (aio.AsyncClaimedRun, "save_checkpoint", async_timer, "save_checkpoint round trip"),
        (runner._Turn, "record", async_timer, "journal a unit (_Turn.record)"),
        (runner._Turn, "save", async_timer, "save: checkpoint + log statement"),
        (AgentRun, "next", async_timer, "pydantic-ai (AgentRun.next)"),
        (outbox_agents, "work", async_timer, "work (claim to done)"),
        (outbox_agents, "start", async_timer, "start"),
        (runner._Turn, "finish", async_timer, "finish (transition to done)"),
        (aio, "claim", async_timer, "claim"),
    ]
    saved = []
    for owner, attr, timer, name in patches:
        original = owner.__dict__[attr]
        saved.append((owner, attr, original))
        setattr(owner, attr, timer(name, original))
    try:
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def profile_round(loop: asyncio.AbstractEventLoop, bench: Bench, runs: int) -> str:
    """A cProfile of *runs* durable runs: the top 15 by cumulative time, then by own time."""
    profiler = cProfile.Profile()

    async def some() -> None:
        for _ in range(runs):
            await bench.durable_run()

    profiler.enable()
    loop.run_until_complete(some())
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    # The event loop's frames and this script's wrap everything: leave them out of the top.
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]  # untyped in typeshed
    for key in list(table):
        filename, _line, function = key
        if "/asyncio/" in filename or filename == __file__ or "_contextvars" in function:
            del table[key]
    stats.sort_stats("cumulative").print_stats(15)
    stats.sort_stats("tottime").print_stats(15)
    return out.getvalue()


# --- the run ------------------------------------------------------------------------------


async def measure(short: Bench, long: Bench, rounds: int,
                  runs: int) -> dict[str, list[float]]:
    """Per round, the median run of bare and durable at two run lengths (order alternating)."""
    samples: dict[str, list[float]] = {}
    for bench in (short, long):
        for _ in range(3):  # warm up: imports, prepared statements, the pool, the workflow row
            await bench.bare()
            await bench.durable_run()
    for round_no in range(rounds):
        kinds = [(f"{kind}_{bench.steps}", fn) for bench in (short, long)
                 for kind, fn in (("bare", bench.bare), ("durable", bench.durable_run))]
        for kind, fn in kinds if round_no % 2 == 0 else reversed(kinds):
            wall, cpu = await bench_timed(fn, runs)
            samples.setdefault(f"{kind}_ms", []).append(wall)
            samples.setdefault(f"{kind}_cpu_ms", []).append(cpu)
        step, per_run = split(samples, short.steps, long.steps, -1)
        print(f"round {round_no + 1}/{rounds}: overhead {step:.3f} ms a step, {per_run:.2f} ms "
              f"a run (bare {samples[f'bare_{long.steps}_ms'][-1]:.2f} ms, durable "
              f"{samples[f'durable_{long.steps}_ms'][-1]:.2f} ms for {long.steps} steps)",
              flush=True)
    return samples


def split(samples: dict[str, list[float]], short: int, long: int, index: int,
          unit: str = "ms") -> tuple[float, float]:
    """(overhead per step, overhead per run) of round *index*: the durable run's extra time
    grows by the per-step cost with each step; what is left at zero steps is per run (start,
    claim, the move to done)."""
    extra_short = samples[f"durable_{short}_{unit}"][index] - samples[f"bare_{short}_{unit}"][index]
    extra_long = samples[f"durable_{long}_{unit}"][index] - samples[f"bare_{long}_{unit}"][index]
    step = (extra_long - extra_short) / (long - short)
    return step, extra_short - step * short


async def bench_timed(fn: Callable[[], Awaitable[None]], runs: int) -> tuple[float, float]:
    """(median wall ms of one run, CPU ms per run) over *runs* runs of *fn*."""
    walls = []
    cpu = time.process_time()
    for _ in range(runs):
        started = time.perf_counter()
        await fn()
        walls.append((time.perf_counter() - started) * 1000)
    return statistics.median(walls), (time.process_time() - cpu) * 1000 / runs


async def breakdown(bench: Bench, runs: int) -> Breakdown:
    """(ms, calls) per durable run of each part."""
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    with instrumented(spent, calls):
        for _ in range(runs):
            await bench.durable_run()
    return {name: (seconds * 1000 / runs, calls[name] / runs) for name, seconds in spent.items()}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOXKIT_DATABASE_URL"))
    parser.add_argument("--json", help="write the figures as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="a smoke run (fewer rounds)")
    parser.add_argument("--steps", type=int, default=12,
                        help="model responses in the long run (the short one has 2)")
    parser.add_argument("--rounds", type=int, help="rounds (default 7; 3 with --quick)")
    parser.add_argument("--runs", type=int, help="runs per kind and round (default 20; 8 quick)")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile round")
    parser.add_argument("--allow-not-durable", action="store_true",
                        help="accepted for the suite; the server's settings are left alone")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("give --database-url or set OUTBOXKIT_DATABASE_URL")
    if args.steps < SHORT + 2:
        parser.error(f"--steps must be >= {SHORT + 2} (the short run has {SHORT})")
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.runs = args.runs or (8 if args.quick else 20)
    return args


def run(args: argparse.Namespace) -> tuple[dict[str, list[float]], Breakdown, str | None]:
    """The timed rounds, the instrumented round and the profile, in a database of our own."""
    name = f"outboxkit_agent_{uuid.uuid4().hex[:8]}"
    admin = create_engine(sqlalchemy_url(args.database_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = sqlalchemy_url(with_database(args.database_url, name))
    loop = asyncio.new_event_loop()
    try:
        sync = create_engine(url)
        migrate(sync)
        sync.dispose()
        engine = create_async_engine(url, pool_size=2)
        short, bench = Bench(engine, SHORT), Bench(engine, args.steps)
        try:
            samples = loop.run_until_complete(measure(short, bench, args.rounds, args.runs))
            parts = loop.run_until_complete(breakdown(bench, args.runs))
            profile = None if args.no_profile else profile_round(loop, bench, args.runs)
        finally:
            loop.run_until_complete(engine.dispose())
    finally:
        loop.close()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    return samples, parts, profile


def print_breakdown(parts: Breakdown, runs: int, steps: int) -> None:
    work = parts.get("work (claim to done)", (0.0, 0))[0] + parts.get("start", (0.0, 0))[0]
    print(f"\nwhere a durable run's {work:.2f} ms go (one instrumented round of {runs} runs, "
          f"{steps} model steps each; per run: ms, calls, share of start + work):")
    for part, (ms, count) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        print(f"  {part:<34} {ms:8.3f} ms {count:5.1f} x  {100 * ms / work if work else 0:5.1f} %")
    print("  (save includes its dump and save_checkpoint; work includes everything but start)")


def figures_of(samples: dict[str, list[float]], steps: int, durability: str) -> list[Figure]:
    """The figures; the last two are the ones with goals (per run, per step)."""
    rounds = range(len(samples[f"bare_{steps}_ms"]))
    splits = [split(samples, SHORT, steps, i) for i in rounds]
    cpu_splits = [split(samples, SHORT, steps, i, "cpu_ms") for i in rounds]
    overhead = statistics.median(s[0] for s in splits)
    per_run = statistics.median(s[1] for s in splits)
    cpu_step = statistics.median(s[0] for s in cpu_splits)
    cpu_run = statistics.median(s[1] for s in cpu_splits)
    bare, durable = (statistics.median(samples[f"{k}_{steps}_ms"]) for k in ("bare", "durable"))
    return [
        Figure("agents.bare_run_ms", bare, "ms",
               note=f"median agent.run of {steps} model steps, no database"),
        Figure("agents.durable_run_ms", durable, "ms",
               note=f"median outbox_agents.start + work of the same {steps} steps"),
        Figure("agents.step_cpu_ms", cpu_step, "ms",
               note="client CPU (process_time) a durable step adds, same split"),
        Figure("agents.run_cpu_ms", cpu_run, "ms",
               note="client CPU a durable run adds whatever its length, same split (what "
               "the wall figures come down to on a busy machine, less the round trips)"),
        Figure("agents.run_overhead_ms", per_run, "ms", None, None, f"<= {RUN_GOAL_MS:g}",
               per_run <= RUN_GOAL_MS,
               note="per run, whatever its length: start, claim, the move to done; median "
               f"over rounds {[round(s[1], 3) for s in splits]}"),
        Figure("agents.step_overhead_ms", overhead, "ms", None, None, f"<= {GOAL_MS:g}",
               overhead <= GOAL_MS,
               note=f"what each model step adds (the growth of durable - bare from {SHORT} to "
               f"{steps} steps, per step), median over rounds "
               f"{[round(s[0], 3) for s in splits]}; async path, {durability}; "
               f"(durable - bare) / steps at {steps} steps: {fmt((durable - bare) / steps)} ms"),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    durability = ", ".join(f"{k}={v}" for k, v in show(args.database_url).items())
    print(f"server durability, left as it is: {durability}", flush=True)
    samples, parts, profile = run(args)
    print_breakdown(parts, args.runs, args.steps)
    if profile is not None:
        print(f"\ncProfile of one round ({args.runs} durable runs of {args.steps} steps), "
              "top 15 by cumulative time, then by own time:")
        print(profile)
    figures = figures_of(samples, args.steps, durability)
    per_run, overhead = figures[-2].value, figures[-1].value
    print()
    print_figures(figures)
    print(f"\nagents.step_overhead_ms = {overhead:.3f} ms (goal <= {GOAL_MS:g} ms): "
          f"{'met' if overhead <= GOAL_MS else 'NOT met'}")
    print(f"agents.run_overhead_ms = {per_run:.3f} ms (goal <= {RUN_GOAL_MS:g} ms): "
          f"{'met' if per_run <= RUN_GOAL_MS else 'NOT met'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"steps": args.steps, "rounds": args.rounds, "runs": args.runs,
                       "samples_ms": samples,
                       "breakdown_per_run": {k: {"ms": ms, "calls": n}
                                             for k, (ms, n) in parts.items()},
                       "figures": [f.as_json() for f in figures]}, out, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
