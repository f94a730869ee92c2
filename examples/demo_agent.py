"""The durable agent demo: a pydantic-ai support agent reorders from a supplier while its
worker is killed mid-run, and no model step is asked twice and no order placed twice —
against a real PostgreSQL, a real Kafka broker and a real HTTP supplier, each component a
separate OS process.

    make demo-agent                  # installs, starts the services, runs this
    python examples/demo_agent.py    # same, once `make bootstrap` has run

What happens:
1. three customers ask about late orders (three agent runs, examples/support_agent);
2. the worker (``outbox worker examples.support_agent.worker:app``) drives them: the model looks the
   order up (a read-only tool, inline), then decides to reorder (an effect tool: a Kafka
   message through the outbox, committed with the run's move to ``waiting``);
3. on purpose, the worker is SIGKILLed right after it committed the model's decision to
   reorder, before sending the message (failpoint ``agent.after_response_commit``);
4. restarted, the worker takes the run over once its lease expires, from its checkpoint:
   it sends the reorder without asking the model again; the relay publishes it, the
   consumer places it at the supplier once (operations ledger) and resumes the run with
   the supplier's order reference, and the agent answers the customer;
5. the summary: each run's path, the model requests made, the supplier's orders, the final
   answers. Exit status 1 if any invariant fails.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

from rich.console import Console
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python examples/demo_agent.py` finds the examples package

import outbox_agents  # noqa: E402
from examples.demo import endpoints  # noqa: E402
from examples.supplier_client import SupplierClient  # noqa: E402
from examples.supplier_order.pipeline import Pipeline, Proc, free_port  # noqa: E402
from examples.support_agent.agent import agent  # noqa: E402
from examples.support_agent.config import MODEL_LOG  # noqa: E402
from outbox import App  # noqa: E402
from outbox.db.dsn import redact, sqlalchemy_url  # noqa: E402

PROMPTS = {
    "A-1001": "Where is my order A-1001? It was due last week.",
    "A-1002": "My order A-1002 still has not shipped, what is going on?",
    "A-1003": "Any news on order A-1003?",
}
STEPS = 3  # model requests per run: look up, reorder, answer
KILL = "agent.after_response_commit=kill@2"  # the first run's decision to reorder
DEADLINE_S = 75.0
console = Console()


class Processes(Pipeline):
    """The example's process handling (pid-only signals, logs, restarts), with this
    example's worker and consumer."""

    COMMANDS = {
        "worker": ["-m", "outbox.cli.main", "worker", "examples.support_agent.worker:app",
                   "--name", "{name}", "--poll-seconds", "1", "--concurrency", "1"],
        "consumer": ["-m", "consumers", "examples.support_agent.consumer:app"],
    }

    def start(self, kind: str, name: str, *, failpoints: str | None = None,
              port: int | None = None) -> Proc:
        if kind not in self.COMMANDS:
            return super().start(kind, name, failpoints=failpoints, port=port)
        old = self.procs.get(name)
        if old is not None and old.alive:
            raise RuntimeError(f"{name} is already running (pid {old.popen.pid})")
        if kind == "consumer" and port is None:
            port = free_port()  # its /readyz and /metrics
        argv = [sys.executable, *(a.format(name=name) for a in self.COMMANDS[kind])]
        log = (self.workdir / f"{name}.log").open("ab")
        popen = subprocess.Popen(argv, env=self.env(kind, name, failpoints, port), cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = Proc(name, kind, popen, log, port)
        return self.procs[name]


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def say(self, line: str) -> None:
        console.print(f"[cyan]{self.elapsed():5.1f}s[/cyan]  {line}", highlight=False)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


async def start_runs(database_url: str, tag: str) -> dict[str, uuid.UUID]:
    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        async with engine.begin() as conn:  # one transaction: all three or none
            return {order: (await outbox_agents.start(conn, agent, prompt, key=f"{tag}-{order}")).id
                    for order, prompt in PROMPTS.items()}
    finally:
        await engine.dispose()


async def outputs(database_url: str, run_ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    engine = create_async_engine(sqlalchemy_url(database_url))
    try:
        async with engine.connect() as conn:
            return {run_id: await outbox_agents.output(conn, agent, run_id) for run_id in run_ids}
    finally:
        await engine.dispose()


def states(engine: Engine, run_ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, state, step FROM outboxkit.agent_runs "
                                 "WHERE id = ANY(:ids)"), {"ids": run_ids}).all()
    return {row.id: (row.state, row.step) for row in rows}


def settled(engine: Engine, run_ids: list[uuid.UUID]) -> bool:
    return all(state in ("done", "failed", "needs-human")
               for state, _ in states(engine, run_ids).values())


def main() -> int:
    # SIGTERM unwinds like Ctrl-C, through the `finally` that stops every process started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    database_url, bootstrap = endpoints()
    engine = create_engine(sqlalchemy_url(database_url), pool_pre_ping=True)
    App().migrate(engine)
    tag = f"demo-agent-{uuid.uuid4().hex[:6]}"
    topic = f"supplier.reorders.{tag}"
    workdir = ROOT / ".services" / "demo-logs" / tag
    model_log = workdir / "model-requests.log"
    console.print(f"PostgreSQL {redact(database_url)}, Kafka {bootstrap}, topic {topic}, "
                  f"logs in {workdir}", highlight=False)
    p = Processes(database_url=database_url, bootstrap=bootstrap, topic=topic, group=tag,
                  workdir=workdir)
    p.overrides["worker"] = {MODEL_LOG: str(model_log)}
    clock = Clock()
    try:
        p.create_topic()
        supplier = SupplierClient(p.start_supplier())
        p.start("consumer", "consumer")
        p.start("relay", "relay")
        while not p.ready("consumer") and p.procs["consumer"].alive and clock.elapsed() < 30:
            time.sleep(0.2)
        run_ids = asyncio.run(start_runs(database_url, tag))
        clock.say(f"{len(run_ids)} support-agent runs queued (one per customer question)")
        killed = run_with_a_kill(p, engine, clock, list(run_ids.values()))
        while not settled(engine, list(run_ids.values())) and clock.elapsed() < DEADLINE_S:
            time.sleep(0.25)
        clock.say("[green]every run settled[/green]" if settled(engine, list(run_ids.values()))
                  else f"[red]not settled within {DEADLINE_S:.0f} s[/red]")
        ok = summary(engine, database_url, supplier, run_ids, model_log=model_log, killed=killed)
        return 0 if ok else 1
    finally:
        p.stop_all()
        engine.dispose()
        console.print("services keep running; stop them with `make services-down`")


def run_with_a_kill(p: Processes, engine: Engine, clock: Clock,
                    run_ids: list[uuid.UUID]) -> bool:
    """Start the worker armed to die after its 2nd committed model response, restart it
    once it died; True if the failpoint killed it (not a kill by hand)."""
    p.start("worker", "worker", failpoints=KILL)
    clock.say(f"worker started (pid {p.procs['worker'].popen.pid}) with "
              f"OUTBOXKIT_FAILPOINTS='{KILL}'")
    deadline = time.monotonic() + 30
    while p.procs["worker"].alive and time.monotonic() < deadline:
        time.sleep(0.05)
    by_failpoint = not p.procs["worker"].alive and p.procs["worker"].popen.returncode == -9
    if by_failpoint:
        clock.say("[red]worker killed[/red] (SIGKILL) after committing a model response, "
                  "before acting on it (failpoint agent.after_response_commit)")
    else:
        p.kill("worker")
        clock.say("[yellow]worker killed by hand[/yellow]: its failpoint was not reached")
    for run_id, (state, step) in states(engine, run_ids).items():
        clock.say(f"  run {str(run_id)[:8]} left {state} at step {step or '-'}")
    p.restart("worker")
    clock.say(f"worker restarted (pid {p.procs['worker'].popen.pid}); the killed run is "
              "taken over when its lease (5 s) expires")
    return by_failpoint


class Summary:
    """Prints what happened and collects every invariant that does not hold."""

    def __init__(self, engine: Engine, database_url: str,
                 run_ids: dict[str, uuid.UUID]) -> None:
        self.engine, self.database_url, self.run_ids = engine, database_url, run_ids
        self.ids = list(run_ids.values())
        self.problems: list[str] = []
        self.figures: list[str] = []  # printed together at the end

    def runs(self, killed: bool) -> list[uuid.UUID]:
        """Each run's path; the runs that are done."""
        if not killed:
            self.problems.append("the worker was not killed by its failpoint")
        final = states(self.engine, self.ids)
        done = [run_id for run_id in self.ids if final[run_id][0] == "done"]
        self.problems += [f"run {run_id} ended {final[run_id][0]}" for run_id in self.ids
                          if run_id not in done]
        console.print("\n[bold]each run's path[/bold] (app.history: from -> to, step, reason)")
        with self.engine.connect() as conn:
            for order, run_id in self.run_ids.items():
                console.print(f"run {run_id} ({order}):", highlight=False)
                for t in App().history(conn, run_id):
                    console.print(f"    {t.from_state or '-':>8} -> {t.to_state:<8} "
                                  f"{t.step or '-':<24} {t.reason or ''}", highlight=False)
        self.figures.append(f"runs done: {len(done)} of {len(self.ids)}")
        return done

    def model_requests(self, model_log: Path) -> None:
        """Every request the scripted model got: each step of each run asked once."""
        asked = Counter(model_log.read_text().splitlines() if model_log.exists() else [])
        console.print(f"\n[bold]model requests[/bold], in the order asked ({model_log.name}: "
                      "times asked, prompt, step)")
        for line, times in asked.items():
            console.print(f"    {times} x {line.replace(chr(9), '  ')}", highlight=False)
        repeated = sum(1 for times in asked.values() if times > 1)
        for order, prompt in PROMPTS.items():
            steps = [line for line in asked if line.startswith(prompt + "\t")]
            if len(steps) != STEPS:
                self.problems.append(f"{order}: {len(steps)} distinct model steps, not {STEPS}")
        if repeated:
            self.problems.append(f"{repeated} model steps were asked more than once")
        self.figures.append(f"model requests: {sum(asked.values())} for {len(asked)} steps; "
                            f"steps asked twice: {repeated}")

    def orders(self, supplier: SupplierClient) -> dict[str, str]:
        """One reorder message, one ledger operation, one supplier order per run; the
        supplier's order id of each customer order."""
        with self.engine.connect() as conn:
            messages: dict[uuid.UUID, int] = dict(conn.execute(text(
                "SELECT run_id, count(*) FROM outboxkit.outbox_messages "
                "WHERE run_id = ANY(:ids) GROUP BY 1"), {"ids": self.ids}).all())
            operations = conn.execute(text(
                "SELECT run_id, status FROM outboxkit.operations WHERE run_id = ANY(:ids)"),
                {"ids": self.ids}).all()
        record = supplier.record()
        console.print("\n[bold]the supplier's orders[/bold] (GET /orders/all)")
        for o in record["orders"]:
            request = o["request"]
            console.print(f"    {o['order_id']}  {request['qty']} x {request['item']} for "
                          f"{request['order_id']}  ({o['posts']} POST)", highlight=False)
        by_order = Counter(o["request"]["order_id"] for o in record["orders"])
        ops_of = Counter(op.run_id for op in operations if op.status == "confirmed")
        for order, run_id in self.run_ids.items():
            for what, count in (("orders at the supplier", by_order[order]),
                                ("reorder messages", messages.get(run_id, 0)),
                                ("confirmed ledger operations", ops_of[run_id])):
                if count != 1:
                    self.problems.append(f"{order}: {count} {what}, not 1")
        if len(operations) != len(self.ids):
            self.problems.append(f"{len(operations)} ledger operations for {len(self.ids)} runs")
        repeats = sum(record["repeat_posts"].values())
        if repeats:
            self.problems.append(f"{repeats} repeated POSTs of an order already placed")
        self.figures.append(f"reorder messages committed: {sum(messages.values())} for "
                            f"{len(self.ids)} runs")
        self.figures.append(f"orders at the supplier: {len(record['orders'])} for "
                            f"{len(self.ids)} runs, repeated POSTs: {repeats}")
        return {o["request"]["order_id"]: o["order_id"] for o in record["orders"]}

    def answers(self, done: list[uuid.UUID], reference_of: dict[str, str]) -> None:
        """The agent's answers (outbox_agents.output), each with the supplier's reference."""
        answers = asyncio.run(outputs(self.database_url, done))
        console.print("\n[bold]final answers[/bold]")
        for order, run_id in self.run_ids.items():
            answer = answers.get(run_id, "-")
            console.print(f"    {order}: {answer}", highlight=False)
            reference = reference_of.get(order)
            if reference is None or reference not in answer:
                self.problems.append(f"{order}: the answer does not give the supplier's "
                                     f"order {reference}")

    def verdict(self) -> bool:
        print()
        for line in self.figures:
            print(line)
        for problem in self.problems:
            console.print(f"[red]INVARIANT FAILED[/red] {problem}", highlight=False)
        if not self.problems:
            console.print("[bold green]all invariants hold[/bold green]: the killed run "
                          "resumed from its checkpoint, no model step asked twice, one order "
                          "per run, every answer carries the supplier's reference")
        return not self.problems


def summary(engine: Engine, database_url: str, supplier: SupplierClient,
            run_ids: dict[str, uuid.UUID], *, model_log: Path, killed: bool) -> bool:
    report = Summary(engine, database_url, run_ids)
    done = report.runs(killed)
    report.model_requests(model_log)
    reference_of = report.orders(supplier)
    report.answers(done, reference_of)
    return report.verdict()


if __name__ == "__main__":
    raise SystemExit(main())
