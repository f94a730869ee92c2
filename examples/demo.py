"""The outboxkit demo: an agent orders from a supplier while we kill things, and nothing is
lost or ordered twice — against a real PostgreSQL, a real Kafka broker and a real HTTP
supplier, each component a separate OS process.

    make demo                      # installs, starts the services, runs this
    python examples/demo.py        # same, once `make bootstrap` has run

What happens:
1. eight supplier-order runs are queued; two agent workers decide each one and commit
   "waiting" plus an ``order.submit`` message in ONE transaction;
2. the relay publishes them to Kafka; the consumer places each order at the supplier
   through the operations ledger, with an idempotency key;
3. on purpose: the relay is killed after Kafka acknowledged a batch but before marking it
   published, the consumer is killed after committing its work but before committing the
   Kafka offset, the supplier applies one order and then times out, and refuses another;
4. the killed processes restart; the relay re-sends what it had not marked (same message
   ids), the consumer drops the redelivered duplicates, the timed-out order is reconciled
   by asking the supplier for its status — never ordered again;
5. the summary: runs and their final states, messages, duplicates, orders at the supplier,
   and how the unknown outcome was settled. Exit status 1 if any invariant fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import deque
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from sqlalchemy import Engine, create_engine, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python examples/demo.py` finds the examples package

from examples.supplier_client import SupplierClient  # noqa: E402
from examples.supplier_order import agent, invariants  # noqa: E402
from examples.supplier_order.pipeline import Pipeline  # noqa: E402
from outbox import App  # noqa: E402
from outbox.db.dsn import redact, sqlalchemy_url  # noqa: E402
from outbox.testing.services import LocalServices  # noqa: E402

ORDERS = 8
TIMEOUT_ITEM, REFUSED_ITEM = "widget-3", "widget-5"
console = Console()


COMPOSE_DATABASE_URL = "postgresql://outboxkit:outboxkit@127.0.0.1:5432/outboxkit"
COMPOSE_BOOTSTRAP = "127.0.0.1:9092"  # as docker-compose.yml publishes them


def docker_answers() -> bool:
    return bool(shutil.which("docker")) and subprocess.run(
        ["docker", "info"], capture_output=True, check=False, timeout=20).returncode == 0


def endpoints() -> tuple[str, str]:
    """OUTBOXKIT_DATABASE_URL / OUTBOXKIT_KAFKA_BOOTSTRAP if set; else `docker compose up`
    when a Docker engine answers; else local processes (no Docker needed)."""
    database_url = os.environ.get("OUTBOXKIT_DATABASE_URL")
    bootstrap = os.environ.get("OUTBOXKIT_KAFKA_BOOTSTRAP")
    if database_url and bootstrap:
        return database_url, bootstrap
    if docker_answers():
        with console.status("starting PostgreSQL and Kafka with docker compose"):
            up = subprocess.run(["docker", "compose", "up", "-d", "--wait", "postgres", "kafka"],
                                cwd=ROOT, capture_output=True, text=True, check=False)
        if up.returncode == 0:
            return COMPOSE_DATABASE_URL, COMPOSE_BOOTSTRAP
        console.print(f"[yellow]docker compose failed ({up.stderr.strip()[-300:]}); "
                      "using local processes instead[/yellow]")
    with console.status("starting PostgreSQL and Kafka (local processes, no Docker needed)"):
        found = LocalServices(ROOT / ".services").up()
    return found.database_url, found.kafka_bootstrap


class Demo:
    def __init__(self, engine: Engine, pipeline: Pipeline, run_ids: list[uuid.UUID]) -> None:
        self.engine, self.p, self.run_ids = engine, pipeline, run_ids
        self.events: deque[str] = deque(maxlen=9)
        self.t0 = time.monotonic()
        self.killed: set[str] = set()

    def say(self, line: str) -> None:
        self.events.append(f"[cyan]{time.monotonic() - self.t0:5.1f}s[/cyan]  {line}")

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        with self.engine.connect() as conn:
            runs = dict(conn.execute(text(
                "SELECT state, count(*) FROM outboxkit.agent_runs WHERE id = ANY(:ids) "
                "GROUP BY 1"), {"ids": self.run_ids}).all())
            msgs = dict(conn.execute(text(
                "SELECT status, count(*) FROM outboxkit.message_status "
                "WHERE run_id = ANY(:ids) GROUP BY 1"), {"ids": self.run_ids}).all())
        return runs, msgs

    def view(self) -> Group:
        runs, msgs = self.counts()
        procs = Table(title="processes", expand=True)
        for col in ("name", "pid", "state"):
            procs.add_column(col)
        for name, proc in self.p.procs.items():
            state = ("[green]running[/green]" if proc.alive else "[red]killed[/red]")
            if proc.alive and name in self.killed:
                state = "[yellow]restarted[/yellow]"
            procs.add_row(name, str(proc.popen.pid), state)
        progress = Table(title="progress", expand=True)
        progress.add_column("what")
        progress.add_column("count", justify="right")
        for state in ("queued", "running", "waiting", "done", "failed", "needs-human"):
            progress.add_row(f"runs {state}", str(runs.get(state, 0)))
        for status in ("pending", "published"):
            progress.add_row(f"messages {status}", str(msgs.get(status, 0)))
        grid = Table.grid(expand=True)
        grid.add_row(procs, progress)
        return Group(grid, Panel("\n".join(self.events) or " ", title="what just happened"))

    def settled(self) -> bool:
        runs, msgs = self.counts()
        final = sum(runs.get(s, 0) for s in ("done", "failed", "needs-human"))
        return final == len(self.run_ids) and msgs.get("pending", 0) == 0

    def watch_kill(self, name: str, what: str) -> None:
        """A process armed with a kill failpoint died: say so and restart it clean."""
        if name not in self.killed and not self.p.procs[name].alive:
            self.killed.add(name)
            self.say(f"[red]{name} killed[/red] {what}")
            self.p.restart(name)
            self.say(f"{name} restarted (pid {self.p.procs[name].popen.pid})")


def main() -> int:
    database_url, bootstrap = endpoints()
    engine = create_engine(sqlalchemy_url(database_url), pool_pre_ping=True)
    App().migrate(engine)
    topic = f"order.submit.demo-{uuid.uuid4().hex[:6]}"
    console.print(f"PostgreSQL {redact(database_url)}, Kafka {bootstrap}, topic {topic}")
    p = Pipeline(database_url=database_url, bootstrap=bootstrap, topic=topic,
                 group=f"demo-{topic}", workdir=ROOT / ".services" / "demo-logs" / topic)
    p.create_topic()
    supplier = SupplierClient(p.start_supplier())
    supplier.control(items={TIMEOUT_ITEM: {"mode": "apply-then-timeout", "delay": 2.5,
                                           "times": 1},
                            REFUSED_ITEM: {"mode": "refuse"}})
    p.start("consumer", "consumer", failpoints="consumer.after_db_commit=kill@2")
    p.start("relay", "relay", failpoints="relay.after_ack=kill@2")
    p.start("reconciler", "reconciler")
    while not p.ready("consumer") and p.procs["consumer"].alive:
        time.sleep(0.2)
    run_ids = agent.seed(engine, [f"widget-{i}" for i in range(ORDERS)], batch=topic)
    demo = Demo(engine, p, run_ids)
    demo.say(f"{ORDERS} supplier-order runs queued; the supplier will time out after "
             f"applying {TIMEOUT_ITEM} and refuse {REFUSED_ITEM}")
    for name in ("agent-1", "agent-2"):
        p.start("agent", name)
    demo.say("2 agent workers commit 'waiting' + order.submit in one transaction per run")
    ok = False
    try:
        with Live(demo.view(), console=console, refresh_per_second=4, transient=False) as live:
            deadline = time.monotonic() + 90
            killed = {"relay", "consumer"}
            while time.monotonic() < deadline and not (demo.settled() and killed <= demo.killed):
                # A failpoint not reached (every run settled first, or 25 s went by: the relay
                # can publish all the runs in one batch, before its second acknowledgement):
                # kill by hand, so the recovery is shown every time.
                if demo.settled() or time.monotonic() - demo.t0 > 25:
                    for name in sorted(killed - demo.killed):
                        p.kill(name)
                        demo.watch_kill(name, "by hand (SIGKILL): its failpoint was not reached")
                demo.watch_kill("relay", "after Kafka acked a batch, before marking it "
                                "published (failpoint relay.after_ack)")
                demo.watch_kill("consumer", "after committing its work, before committing "
                                "the Kafka offset (failpoint consumer.after_db_commit)")
                live.update(demo.view())
                time.sleep(0.25)
            demo.say("[green]every run settled[/green]" if demo.settled()
                     else "[red]not settled within 90 s[/red]")
            live.update(demo.view())
        console.print()
        ok = summary(engine, p, supplier, run_ids, demo)
    finally:
        p.stop_all()
        engine.dispose()
    console.print("services keep running; see this demo's runs, its reconciled order and its "
                  "refused one in the operator console: `make console`; stop the services "
                  "with `make services-down`")
    return 0 if ok else 1


def summary(engine: Engine, p: Pipeline, supplier: SupplierClient, run_ids: list[uuid.UUID],
            demo: Demo) -> bool:
    found = invariants.check(engine, bootstrap=p.bootstrap, topic=p.topic, supplier=supplier,
                             run_ids=run_ids)
    dropped = int(p.metric("consumer", "outboxkit_consumer_duplicates_total") or 0)
    with engine.connect() as conn:
        runs = conn.execute(text(
            "SELECT checkpoint->>'item', state, last_evidence->>'reference', reason "
            "FROM outboxkit.agent_runs WHERE id = ANY(:ids) ORDER BY checkpoint->>'item'"),
            {"ids": run_ids}).all()
        paths = dict(conn.execute(text(
            "SELECT r.checkpoint->>'item', string_agg(e.kind || ':' || e.outcome, ' ' "
            "ORDER BY e.id) FROM outboxkit.agent_runs r JOIN outboxkit.operations o "
            "ON o.run_id = r.id JOIN outboxkit.operation_events e ON e.operation_id = o.id "
            "WHERE r.id = ANY(:ids) GROUP BY 1"), {"ids": run_ids}).all())
    table = Table(title="runs and how each ended")
    for col in ("item", "final state", "supplier order", "path at the supplier"):
        table.add_column(col)
    for item, state, ref, reason in runs:
        path = invariants.path_of((paths.get(item) or "").split())
        table.add_row(item, state, ref or f"- ({reason})", path)
    console.print(table)
    console.print(
        f"messages committed {found.committed}, in Kafka {found.in_kafka} "
        f"(+{found.duplicates_delivered} duplicate copies the killed relay re-sent)\n"
        f"duplicates dropped by the consumer since its restart: {dropped}\n"
        f"orders at the supplier: {found.supplier_effects} for "
        f"{found.runs_by_state.get('done', 0)} done runs, repeated POSTs of a placed order: "
        f"{found.blind_repeats}\n"
        f"unknown outcomes reconciled by a status query: {found.unknown_reconciled}, "
        f"escalated to a human: {found.unknown_escalated}")
    for problem in found.violations:
        console.print(f"[red]INVARIANT FAILED[/red] {problem}")
    if found.ok:
        console.print("[bold green]all invariants hold[/bold green]: nothing lost, no order "
                      "placed twice, every run settled with evidence")
    return found.ok


if __name__ == "__main__":
    raise SystemExit(main())
