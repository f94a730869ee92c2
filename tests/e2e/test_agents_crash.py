"""Durable agent workers SIGKILLed at every step boundary, as real OS processes on a real
PostgreSQL (and Kafka on the confirmation's real path): the run still ends with the uncrashed
answer, the model is asked once per committed step, and the effect goes out as one message
and is performed once. Then the lease: a worker whose lease was taken over writes nothing,
and two workers on one run never both write.

The agent is tests/e2e/agents_crash_worker.py (``python -m tests.e2e.agents_crash_worker``);
the supplier's consumer is tests/e2e/agents_crash_consumer.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

import outbox_agents
from outbox import aio
from outbox.db.dsn import sqlalchemy_url
from outbox.runs.approvals import grant
from outbox.runs.confirm import apply_confirmation
from outbox.runs.states import RunState
from outbox.testing.processes import free_port
from outbox_agents import effect_message_id, journal
from tests.e2e.agents_crash_consumer import EFFECTS_DDL, reference
from tests.e2e.agents_crash_worker import (
    ANSWER,
    PROMPT,
    REORDER_CALL,
    UNCRASHED_REQUESTS,
    build,
    drive,
)
from tests.e2e.conftest import RelayProcesses, wait_until
from tests.e2e.consumer_support import wait_for_metric

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = {"reference": reference("widget", 3)}
LEASE = 1.5
"""The worker processes' lease (s): a killed worker's lease must run out before the next
worker claims the run, so it is short. One worker runs at a time and writes are fenced by the
lease's token, not its expiry, so a slow live worker loses nothing by overrunning it."""
UNCRASHED_HISTORIES = [1, 3, 5]
"""The history length of each model request of an uncrashed run (prompt; + lookup call and
result; + reorder call and result)."""


@dataclass
class Harness:
    """One test's run: its database, its request log, its worker and consumer processes."""

    database_url: str
    kafka_bootstrap: str
    tmp_path: Path
    topic: str
    engine: Engine
    run_id: uuid.UUID | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    approval: bool = False
    """The effect needs a person's approval."""

    @property
    def requests_file(self) -> Path:
        return self.tmp_path / "model-requests"

    def requests(self) -> list[str]:
        """One line per model request, from every worker, killed or not: 'pid history-len'."""
        if not self.requests_file.exists():
            return []
        return self.requests_file.read_text().splitlines()

    def start(self) -> uuid.UUID:
        agent = build(self.topic, self.requests_file, lease_seconds=LEASE,
                      requires_approval=self.approval)

        async def go() -> uuid.UUID:
            engine = create_async_engine(sqlalchemy_url(self.database_url))
            try:
                async with engine.begin() as conn:
                    run = await outbox_agents.start(conn, agent, PROMPT, key="ticket-A1")
            finally:
                await engine.dispose()
            return run.id

        self.run_id = asyncio.run(go())
        return self.run_id

    def worker(self, failpoints: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "OUTBOXKIT_FAILPOINTS"}
        env.update({
            "AGENTS_CRASH_DATABASE_URL": self.database_url,
            "AGENTS_CRASH_REQUESTS": str(self.requests_file),
            "AGENTS_CRASH_TOPIC": self.topic,
            "AGENTS_CRASH_LEASE": str(LEASE),
            "AGENTS_CRASH_APPROVAL": "1" if self.approval else "0",
        })
        if failpoints:
            env["OUTBOXKIT_FAILPOINTS"] = failpoints
        return subprocess.run(
            [sys.executable, "-m", "tests.e2e.agents_crash_worker"], env=env, cwd=ROOT,
            capture_output=True, text=True, timeout=90, check=False)

    def sql(self, statement: str, **params: Any) -> list[Any]:
        with self.engine.begin() as conn:
            result = conn.execute(text(statement), params)
            return list(result.all()) if result.returns_rows else []

    def state(self) -> str:
        return str(self.sql("SELECT state FROM outboxkit.agent_runs WHERE id = :r",
                            r=self.run_id)[0][0])

    def messages(self) -> list[uuid.UUID]:
        """The run's outbox messages (their ids), in the order written."""
        rows = self.sql("SELECT message_id FROM outboxkit.outbox_messages WHERE run_id = :r "
                        "ORDER BY id", r=self.run_id)
        return [r[0] for r in rows]

    def confirm_directly(self, message_id: uuid.UUID) -> None:
        """The consumer's confirmation without Kafka: the call ctx.confirm makes."""
        assert self.run_id is not None
        with self.engine.begin() as conn:
            assert apply_confirmation(conn, run_id=self.run_id, confirmation_id=str(message_id),
                                      outcome="running", evidence=EVIDENCE, actor="test")

    def consumer(self, group_id: str, http_port: int = 0,
                 failpoints: str | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != "OUTBOXKIT_FAILPOINTS"}
        env.update({
            "OUTBOXKIT_CONSUMER_DATABASE_URL": sqlalchemy_url(self.database_url),
            "OUTBOXKIT_CONSUMER_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "OUTBOXKIT_CONSUMER_SESSION_TIMEOUT_MS": "6000",
            "OUTBOXKIT_CONSUMER_POLL_TIMEOUT_MS": "200",
            "OUTBOXKIT_CONSUMER_HTTP_PORT": str(http_port),
            "OUTBOXKIT_CONSUMER_GROUP_ID": group_id,
            "AGENTS_CRASH_TOPIC": self.topic,
        })
        if failpoints:
            env["OUTBOXKIT_FAILPOINTS"] = failpoints
        log = (self.tmp_path / f"consumer-{len(self.procs)}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "consumers", "tests.e2e.agents_crash_consumer:app"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.tmp_path.glob("*.log")))

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def harness(database_url: str, kafka_bootstrap: str, tmp_path: Path) -> Iterator[Harness]:
    engine = create_engine(sqlalchemy_url(database_url))
    h = Harness(database_url, kafka_bootstrap, tmp_path,
                topic=f"agents-crash-{uuid.uuid4().hex[:8]}", engine=engine)
    h.sql(EFFECTS_DDL)
    try:
        yield h
    finally:
        h.stop_all()
        engine.dispose()


def play(h: Harness, failpoints: str | None, confirm: Callable[[uuid.UUID], None], *,
         resumed: bool = False) -> list[str]:
    """Run workers and the confirmation side until the run is done; what each worker did:
    killed, waiting, done. The workers get *failpoints* until one is killed (with *resumed*,
    only those after the confirmation: a failpoint counts its hits in its own process)."""
    outcomes: list[str] = []
    confirmed = False
    for _ in range(6):
        armed = "killed" not in outcomes and (confirmed or not resumed)
        proc = h.worker(failpoints if armed else None)
        if proc.returncode == -signal.SIGKILL:
            outcomes.append("killed")
            if h.state() == RunState.DONE.value:  # killed right after its last commit
                return outcomes
        else:
            assert proc.returncode == 0, proc.stderr
            result = json.loads(proc.stdout.splitlines()[-1])
            outcomes.append(result["state"])
            if result["state"] == "done":
                assert result["output"] == ANSWER
                return outcomes
        if h.state() == RunState.WAITING.value:
            assert not confirmed, "the run waits a second time"
            (message_id,) = h.messages()
            confirm(message_id)
            confirmed = True
    raise AssertionError(f"the run was not done after {outcomes}")


def assert_one_effect_message(h: Harness) -> uuid.UUID:
    assert h.run_id is not None
    expected = effect_message_id(h.run_id, REORDER_CALL)
    assert h.messages() == [expected]
    (row,) = h.sql("SELECT topic, key, payload FROM outboxkit.outbox_messages WHERE run_id = :r",
                   r=h.run_id)
    assert (row[0], bytes(row[1]), json.loads(bytes(row[2]))) == (
        h.topic, b"widget", {"item": "widget", "qty": 3})
    # The one confirmation the run took is that message's, with its evidence.
    confirmations = h.sql("SELECT confirmation_id, evidence FROM outboxkit.confirmations "
                          "WHERE run_id = :r", r=h.run_id)
    assert [(c[0], c[1]) for c in confirmations] == [(str(expected), EVIDENCE)]
    return expected


def assert_done_once(h: Harness) -> None:
    moves = h.sql("SELECT to_state FROM outboxkit.run_transitions WHERE run_id = :r ORDER BY id",
                  r=h.run_id)
    to_states = [m[0] for m in moves]
    assert to_states.count("waiting") == 1
    assert to_states.count("done") == 1
    assert to_states[-1] == "done"
    (output,) = h.sql("SELECT checkpoint->'output' FROM outboxkit.agent_runs WHERE id = :r",
                      r=h.run_id)[0]
    assert output == ANSWER


def test_an_uncrashed_run_asks_the_model_three_times_and_answers(harness: Harness) -> None:
    harness.start()
    outcomes = play(harness, None, harness.confirm_directly)
    assert outcomes == ["waiting", "done"]
    assert len(harness.requests()) == UNCRASHED_REQUESTS
    assert [int(line.split()[1]) for line in harness.requests()] == UNCRASHED_HISTORIES
    assert_one_effect_message(harness)
    assert_done_once(harness)


def boundary(point: str, hit: int, *, resumed: bool = False, marks: Any = ()) -> Any:
    phase = "resumed" if resumed else "first"
    return pytest.param(point, hit, resumed, id=f"{point}@{hit}-{phase}", marks=marks)


# (failpoint, hit, in the resumed worker): every boundary a worker commits at. The first
# worker's model responses are the lookup call (1st hit) and the reorder call (2nd); the
# resumed worker's (after the confirmation) is the answer.
BOUNDARIES = [
    boundary("agent.before_response_commit", 1),
    boundary("agent.before_response_commit", 2),
    boundary("agent.after_response_commit", 1),
    boundary("agent.after_response_commit", 2),
    boundary("agent.before_effect_commit", 1),
    boundary("agent.after_effect_commit", 1),
    boundary("agent.after_confirmation", 1, resumed=True),
    boundary("agent.before_response_commit", 1, resumed=True),
    # The answer commits with the move to done (pydantic-ai cannot resume from a history
    # that ends with an answer: it would ask the model again): killed after it, it is done.
    boundary("agent.after_response_commit", 1, resumed=True),
]


@pytest.mark.parametrize(("point", "hit", "resumed"), BOUNDARIES)
def test_a_worker_killed_at_a_step_boundary_changes_nothing_in_the_outcome(
        harness: Harness, point: str, hit: int, resumed: bool) -> None:
    run_id = harness.start()
    # The confirmation side is applied directly here (apply_confirmation, as ctx.confirm
    # does in the consumer's transaction) to keep the module fast; the Kafka path, relay and
    # consumer processes, is the next test's.
    outcomes = play(harness, f"{point}=kill@{hit}", harness.confirm_directly, resumed=resumed)

    if resumed and point == "agent.after_response_commit":
        assert outcomes == ["waiting", "killed"]
    elif resumed:
        assert outcomes == ["waiting", "killed", "done"]
    elif point == "agent.after_effect_commit":  # the run waits: nothing for a worker to do
        assert outcomes == ["killed", "done"]
    else:
        assert outcomes == ["killed", "waiting", "done"]
    # Once per committed step: only the response lost before its commit is asked again, and
    # it is the same request (the same history length) as the lost one.
    lengths = [int(line.split()[1]) for line in harness.requests()]
    if point == "agent.before_response_commit":
        lost = UNCRASHED_HISTORIES[2 if resumed else hit - 1]
        assert sorted(lengths) == sorted([*UNCRASHED_HISTORIES, lost])
        assert len(lengths) == UNCRASHED_REQUESTS + 1
    else:
        assert lengths == UNCRASHED_HISTORIES
    assert_one_effect_message(harness)
    assert_done_once(harness)
    # No consumer ran: the effect is the one confirmation applied (checked above).
    assert harness.sql("SELECT count(*) FROM public.agent_crash_effects")[0][0] == 0
    assert run_id == harness.run_id


def test_a_worker_killed_after_its_effect_committed_is_confirmed_through_kafka(
        harness: Harness, database_url: str, kafka_bootstrap: str,
        kafka_topic: Callable[..., str], relays: RelayProcesses) -> None:
    """The real path: the relay publishes the message, a consumer process performs the effect
    and confirms the run in the same transaction, and is killed before its offsets commit; its
    successor gets the message again and the dedup drops it."""
    harness.topic = kafka_topic(partitions=1)
    run_id = harness.start()
    relays.start()
    group = f"agents-crash-{uuid.uuid4().hex[:8]}"
    doomed = harness.consumer(group, failpoints="consumer.after_db_commit=kill@1")
    metrics_port = free_port()
    successor: list[subprocess.Popen[bytes]] = []

    def through_kafka(message_id: uuid.UUID) -> None:
        assert doomed.wait(timeout=90) == -signal.SIGKILL, harness.logs()
        successor.append(harness.consumer(group, http_port=metrics_port))
        wait_until(lambda: harness.state() != RunState.WAITING.value, 30, "the confirmation")

    outcomes = play(harness, "agent.after_effect_commit=kill@1", through_kafka)
    assert outcomes == ["killed", "done"]
    assert [int(line.split()[1]) for line in harness.requests()] == UNCRASHED_HISTORIES
    message_id = assert_one_effect_message(harness)
    assert_done_once(harness)
    # The redelivery reached the successor and changed nothing.
    assert wait_for_metric(metrics_port, "outboxkit_consumer_duplicates_total",
                           lambda v: v >= 1, 60) == 1, harness.logs()
    effects = harness.sql("SELECT message_id, run_id, item, qty FROM public.agent_crash_effects")
    assert [tuple(e) for e in effects] == [(str(message_id), run_id, "widget", 3)]
    assert successor[0].poll() is None, harness.logs()


def test_a_worker_whose_lease_was_taken_over_writes_nothing_more(
        harness: Harness, database_url: str) -> None:
    run_id = harness.start()
    held = asyncio.Event()
    release = asyncio.Event()

    async def hang() -> None:
        # A stalled worker (a frozen VM, a long pause): its lease heartbeat cannot run either.
        # Holding the turn's write lock stops it, as the stall would; a model call that is
        # merely slow keeps its lease (test_agents_capability's heartbeat test).
        turn: Any = journal.CURRENT.get()
        async with turn._writes:
            held.set()
            await release.wait()

    async def scenario() -> tuple[Any, dict[str, Any]]:
        engine_a = create_async_engine(sqlalchemy_url(database_url))
        engine_b = create_async_engine(sqlalchemy_url(database_url))
        a = build(harness.topic, harness.tmp_path / "a-requests", lease_seconds=1, hold=hang)
        b = build(harness.topic, harness.tmp_path / "b-requests", lease_seconds=30)
        try:
            task_a = asyncio.create_task(outbox_agents.work(engine_a, a, worker="A"))
            await asyncio.wait_for(held.wait(), 30)  # A claimed and is inside its first call
            await asyncio.sleep(1.2)  # A's 1 s lease runs out
            first = await drive(b, engine_b, worker="B", timeout=30)
            assert first["state"] == "waiting"
            harness.confirm_directly(effect_message_id(run_id, REORDER_CALL))
            second = await drive(b, engine_b, worker="B", timeout=30)
            assert not task_a.done()
            release.set()  # A's model call returns; its next write finds the lease gone
            return await asyncio.wait_for(task_a, 30), second
        finally:
            await engine_a.dispose()
            await engine_b.dispose()

    progress_a, done_b = asyncio.run(scenario())
    assert done_b["state"] == "done"
    assert done_b["output"] == ANSWER
    assert progress_a.state is RunState.RUNNING
    assert progress_a.reason is not None
    assert f"lease on run {run_id} lost" in progress_a.reason
    assert progress_a.model_requests == 1
    assert (harness.tmp_path / "b-requests").read_text().count("\n") == UNCRASHED_REQUESTS
    moves = harness.sql("SELECT to_state, actor, reason, lease_token FROM "
                        "outboxkit.run_transitions WHERE run_id = :r ORDER BY id", r=run_id)
    claims = [m for m in moves if m[2] and m[2].startswith(("claimed by", "lease expired"))]
    assert [m[2] for m in claims[:2]] == ["claimed by A", "lease expired, resumed by B"]
    takeover = moves.index(claims[1])
    a_token = moves[takeover - 1][3]
    # After the takeover, every move is B's (a newer token); A's token appears nowhere.
    assert all(m[3] is None or m[3] > a_token for m in moves[takeover:]), moves
    assert [m[0] for m in moves[takeover:]][-1] == "done"
    assert_one_effect_message(harness)
    assert_done_once(harness)
    (step,) = harness.sql("SELECT step FROM outboxkit.agent_runs WHERE id = :r", r=run_id)[0]
    assert step == "done"


def test_two_workers_on_one_run_only_the_lease_holder_writes(
        harness: Harness, database_url: str) -> None:
    run_id = harness.start()

    async def worker(name: str, progress: list[Any]) -> None:
        engine = create_async_engine(sqlalchemy_url(database_url))
        # A slow model (0.2 s a request): the other worker polls while this one holds it.
        agent = build(harness.topic, harness.tmp_path / f"{name}-requests",
                      lease_seconds=30, delay=0.2)
        try:
            for _ in range(400):
                got = await outbox_agents.work(engine, agent, worker=name)
                progress.append(got)
                if got is not None and got.state is RunState.DONE:
                    return
                async with engine.connect() as conn:
                    if (await aio.get_run(conn, run_id)).state is RunState.DONE:
                        return
                await asyncio.sleep(0.02)
        finally:
            await engine.dispose()

    async def confirmer() -> None:
        while harness.state() != RunState.WAITING.value:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # both workers find the waiting run with nothing to do
        harness.confirm_directly(effect_message_id(run_id, REORDER_CALL))

    seen: dict[str, list[Any]] = {"A": [], "B": []}

    async def scenario() -> None:
        await asyncio.wait_for(asyncio.gather(
            worker("A", seen["A"]), worker("B", seen["B"]), confirmer()), 60)

    asyncio.run(scenario())
    worked = [p for ps in seen.values() for p in ps if p is not None]
    nones = [p for ps in seen.values() for p in ps if p is None]
    assert nones, "no worker ever found the run taken"
    assert [p.state for p in worked].count(RunState.DONE) == 1
    assert all(p.state in (RunState.WAITING, RunState.DONE) for p in worked), worked
    assert all(p.output == ANSWER for p in worked if p.state is RunState.DONE)
    total = sum((harness.tmp_path / f"{n}-requests").read_text().count("\n")
                for n in seen if (harness.tmp_path / f"{n}-requests").exists())
    assert total == UNCRASHED_REQUESTS
    assert_one_effect_message(harness)
    assert_done_once(harness)


def test_an_approved_effect_whose_worker_was_killed_after_it_committed_is_sent_once(
        harness: Harness) -> None:
    harness.approval = True
    run_id = harness.start()
    asked = harness.worker()
    assert asked.returncode == 0, asked.stderr
    assert harness.state() == RunState.WAITING.value
    assert harness.messages() == []
    (approval_id,) = harness.sql("SELECT id FROM outboxkit.approvals WHERE run_id = :r",
                                 r=run_id)[0]
    with harness.engine.begin() as conn:
        grant(conn, approval_id, by="alice", reason="the supplier is the usual one")
    # The worker that spends the approval and sends the message dies right after its commit.
    killed = harness.worker("agent.after_effect_commit=kill@1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    expected = effect_message_id(run_id, REORDER_CALL)
    assert harness.messages() == [expected]
    # Its successor finds the approval spent and the message sent: it waits, sends nothing.
    resumed = harness.worker()
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["state"] == "waiting"
    assert harness.messages() == [expected]
    harness.confirm_directly(expected)
    done = harness.worker()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["state"] == "done"
    assert_one_effect_message(harness)
    spent = harness.sql("SELECT granted_by, grant_reason, spent_message_id FROM "
                        "outboxkit.approvals WHERE run_id = :r", r=run_id)
    assert [tuple(row) for row in spent] == [
        ("alice", "the supplier is the usual one", expected)]
