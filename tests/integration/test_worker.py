"""The worker (outbox/worker/) runs registered step functions against real PostgreSQL: what
each step commits, retries, versions, concurrency, wake-ups, probes."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request
from datetime import timedelta
from typing import Any

import psycopg
from pydantic import BaseModel
from sqlalchemy import Engine, text

from outbox import App, ClaimedRun, Envelope, RetryPolicy, RunState, VersionPolicy
from outbox.aio import AsyncClaimedRun
from outbox.handle import claim
from outbox.runs.lifecycle import get_run, history, start_run
from outbox.runs.wakeups import channel, declare_idle
from outbox.testing.processes import free_port
from outbox.worker import WorkerSettings, run_worker_async
from outbox.worker.worker import Worker
from tests.integration.worker_support import run_in, running, wait_for


class Order(BaseModel):
    item: str
    qty: int


def messages(engine: Engine, run_id: Any) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT message_type FROM outboxkit.outbox_messages "
                                      "WHERE run_id = :r"), {"r": run_id}).scalars())


class TestOneStep:
    def test_a_function_that_returns_leaves_the_run_done_with_its_message(
            self, engine: Engine, database_url: str) -> None:
        """The worker validates the checkpoint into the annotation's type, and moves the run to
        done in the step's transaction when the function returns holding the lease."""
        app = App(database_url=database_url)
        seen: list[Any] = []

        @app.workflow("order", version="1")
        def decide(job: ClaimedRun[Order]) -> None:
            seen.append(job.checkpoint)
            job.emit(Envelope(topic="orders", type="order.submit", key="a", payload={}))

        with running(app, name="w-1"):
            with engine.begin() as conn:
                run = app.start_run(conn, decide, idempotency_key="k",
                                    checkpoint=Order(item="bolt", qty=3))
            done = run_in(engine, run.id, "done")
        assert seen == [Order(item="bolt", qty=3)]
        assert done.checkpoint == {"item": "bolt", "qty": 3}
        assert messages(engine, run.id) == ["order.submit"]
        with engine.connect() as conn:
            last = history(conn, run.id)[-1]
        assert (last.to_state, last.actor) == ("done", "w-1")

    def test_a_function_that_moves_the_run_commits_its_message_with_the_move(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("order", version="1")
        def decide(job: ClaimedRun[dict[str, Any]]) -> None:
            job.emit(Envelope(topic="orders", type="order.submit", key="a", payload={}))
            job.transition("waiting", step="submitted", reason="asked the supplier")

        with running(app):
            with engine.begin() as conn:
                run = app.start_run(conn, "order", idempotency_key="k", checkpoint={"n": 1})
            waiting = run_in(engine, run.id, "waiting")
        assert waiting.step == "submitted"
        assert messages(engine, run.id) == ["order.submit"]

    def test_a_failing_step_is_retried_by_its_policy_then_given_up_and_emits_nothing(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)
        policy = RetryPolicy(max_attempts=3, initial_backoff=0.05, jitter=0,
                             give_up_state=RunState.NEEDS_HUMAN)
        calls: list[int] = []

        @app.workflow("flaky", version="1", retry=policy)
        def flaky(job: ClaimedRun[Any]) -> None:
            calls.append(job.run.attempts)
            job.emit(Envelope(topic="orders", type="never", key="a", payload={}))
            raise TimeoutError("supplier did not answer")

        with running(app):
            with engine.begin() as conn:
                run = app.start_run(conn, flaky, idempotency_key="k")
            given_up = run_in(engine, run.id, "needs-human")
        assert calls == [0, 1, 2]
        assert given_up.attempts == 3
        assert "TimeoutError" in (given_up.reason or "")
        assert messages(engine, run.id) == []  # each failed step rolled back, its emit too

    def test_a_checkpoint_that_does_not_fit_the_type_fails_the_run_at_once(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)
        called: list[int] = []

        @app.workflow("order", version="1")
        def decide(job: ClaimedRun[Order]) -> None:
            called.append(1)

        with running(app):
            with engine.begin() as conn:
                run = start_run(conn, workflow="order", workflow_version="1",
                                idempotency_key="k", checkpoint={"item": "bolt"})
            failed = run_in(engine, run.id, "failed")
        assert called == []
        assert "CheckpointInvalid" in (failed.reason or "")
        assert "qty" in (failed.reason or "")


    def test_a_step_whose_lease_was_taken_over_commits_nothing(
            self, engine: Engine, database_url: str) -> None:
        """Fencing holds under the worker: the function outlived its lease, another claimant
        took the run, so its message and the worker's move to done are refused."""
        app = App(database_url=database_url)
        started, taken = threading.Event(), threading.Event()

        @app.workflow("slow", version="1")
        def slow(job: ClaimedRun[Any]) -> None:
            started.set()
            assert taken.wait(10)
            job.emit(Envelope(topic="orders", type="late", key="a", payload={}))

        with running(app, concurrency=1, lease_seconds=0.3) as worker:
            with engine.begin() as conn:
                run = app.start_run(conn, slow, idempotency_key="k")
            assert started.wait(10)

            def steal() -> bool:
                with engine.begin() as conn:
                    return claim(conn, worker="thief", lease_seconds=60) is not None

            wait_for(steal, what="the lease to expire")
            taken.set()
            wait_for(lambda: _count(worker, "slow@1", "lease_lost"), what="the step dropped")
        with engine.connect() as conn:
            assert get_run(conn, run.id).state == "running"
            assert history(conn, run.id)[-1].actor == "thief"
        assert messages(engine, run.id) == []

    def test_writing_after_ending_the_lease_fails_the_run_instead_of_replaying_it(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("buggy", version="1")
        def buggy(job: ClaimedRun[Any]) -> None:
            job.transition("waiting", step="asked", reason="asked")
            job.emit(Envelope(topic="orders", type="too-late", key="a", payload={}))

        with running(app):
            with engine.begin() as conn:
                run = app.start_run(conn, buggy, idempotency_key="k")
            failed = run_in(engine, run.id, "failed")
        assert "LeaseSpent" in (failed.reason or "")
        assert messages(engine, run.id) == []


def _count(worker: Worker, workflow: str, outcome: str) -> float:
    return worker.metrics.registry.get_sample_value(
        "outboxkit_worker_steps_total", {"workflow": workflow, "outcome": outcome}) or 0.0


class TestVersions:
    def test_each_registered_version_runs_its_own_runs_and_others_get_the_newest_policy(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)
        ran: dict[str, str] = {}

        @app.workflow("wf", version="1")
        def v1(job: ClaimedRun[Any]) -> None:
            ran[job.run.idempotency_key] = "1"

        @app.workflow("wf", version="2", on_version_change=VersionPolicy.CONTINUE)
        def v2(job: ClaimedRun[Any]) -> None:
            ran[job.run.idempotency_key] = "2"

        with engine.begin() as conn:
            # A run of a version no worker runs any more: the newest version's policy applies.
            old = start_run(conn, workflow="wf", workflow_version="0", idempotency_key="old")
        with running(app):
            with engine.begin() as conn:
                one = app.start_run(conn, v1, idempotency_key="one")
                two = app.start_run(conn, "wf", idempotency_key="two")  # by name: the newest
            for run in (one, two, old):
                run_in(engine, run.id, "done")
        assert (one.workflow_version, two.workflow_version) == ("1", "2")
        assert ran == {"one": "1", "two": "2", "old": "2"}


class TestConcurrency:
    def test_n_sync_steps_run_at_once(self, engine: Engine, database_url: str) -> None:
        """Three steps wait for each other: they all pass only if all three run together."""
        app = App(database_url=database_url)
        barrier = threading.Barrier(3, timeout=5)

        @app.workflow("meet", version="1", retry=RetryPolicy(max_attempts=1))
        def meet(job: ClaimedRun[Any]) -> None:
            barrier.wait()

        with running(app, concurrency=3):
            with engine.begin() as conn:
                runs = [app.start_run(conn, meet, idempotency_key=f"k{i}") for i in range(3)]
            states = {run_in(engine, r.id, "done", "failed").state for r in runs}
        assert states == {RunState.DONE}

    def test_async_steps_run_at_once_on_the_event_loop(self, engine: Engine,
                                                       database_url: str) -> None:
        app = App(database_url=database_url)
        met: list[str] = []

        async def scenario() -> None:
            barrier = asyncio.Barrier(3)

            @app.workflow("meet", version="1", retry=RetryPolicy(max_attempts=1))
            async def meet(job: AsyncClaimedRun[Order]) -> None:
                await asyncio.wait_for(barrier.wait(), 5)
                met.append(job.checkpoint.item)
                await job.transition("waiting", step="met", reason="all three met")

            stop = asyncio.Event()
            worker = asyncio.create_task(run_worker_async(
                app, settings=WorkerSettings(concurrency=3), stop=stop))
            with engine.begin() as conn:
                runs = [app.start_run(conn, meet, idempotency_key=f"k{i}",
                                      checkpoint=Order(item=f"i{i}", qty=1)) for i in range(3)]
            await asyncio.to_thread(lambda: [run_in(engine, r.id, "waiting") for r in runs])
            stop.set()
            assert await worker == 0

        asyncio.run(scenario())
        assert sorted(met) == ["i0", "i1", "i2"]


class TestClaimThreads:
    """All-sync apps: a claim thread goes on claiming and stepping while runs are claimable."""

    def test_a_streak_counts_every_step_once(self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("many", version="1")
        def many(job: ClaimedRun[Any]) -> None:
            return None

        with engine.begin() as conn:
            runs = [app.start_run(conn, many, idempotency_key=f"k{i}") for i in range(30)]
        with running(app, concurrency=2) as worker:
            for run in runs:
                run_in(engine, run.id, "done")
            wait_for(lambda: _count(worker, "many@1", "done") == 30, what="30 steps counted")
            durations = worker.metrics.registry.get_sample_value(
                "outboxkit_worker_step_seconds_count", {"workflow": "many@1"})
        assert durations == 30
        assert _count(worker, "many@1", "done") == 30

    def test_a_stop_during_a_backlog_ends_the_streaks_after_their_step(
            self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)
        started = threading.Event()
        release = threading.Event()

        @app.workflow("slow", version="1")
        def slow(job: ClaimedRun[Any]) -> None:
            started.set()
            release.wait(10)

        with engine.begin() as conn:
            runs = [app.start_run(conn, slow, idempotency_key=f"k{i}") for i in range(20)]
        worker = Worker(app, WorkerSettings(poll_seconds=30.0, concurrency=1))
        codes: list[int] = []
        thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
        thread.start()
        assert started.wait(10)
        worker.stop()
        release.set()
        thread.join(15)
        assert not thread.is_alive()
        assert codes == [0]
        with engine.connect() as conn:
            states = [get_run(conn, r.id).state for r in runs]
        assert states.count(RunState.DONE) == 1  # the one in flight; nothing claimed after
        assert states.count(RunState.QUEUED) == 19

    def test_a_cancelled_worker_stops_its_claim_threads(
            self, engine: Engine, database_url: str) -> None:
        """No stop(): the task running the worker is cancelled (Ctrl-C under asyncio.run)."""
        app = App(database_url=database_url)
        gate = threading.Event()

        @app.workflow("gated", version="1")
        def gated(job: ClaimedRun[Any]) -> None:
            gate.wait(10)

        with engine.begin() as conn:
            runs = [app.start_run(conn, gated, idempotency_key=f"k{i}") for i in range(20)]

        async def main() -> None:
            task = asyncio.create_task(run_worker_async(
                app, settings=WorkerSettings(poll_seconds=30.0, concurrency=1,
                                             shutdown_timeout_seconds=1)))
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_for(lambda: _states(engine, runs).count(RunState.RUNNING),
                                       what="a step to start"))
            task.cancel()
            await asyncio.sleep(0.05)  # the worker is cancelled, its step still in flight
            gate.set()  # the step ends: a claim thread that went on would claim the next run
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(main())
        time.sleep(0.3)
        states = _states(engine, runs)
        assert states.count(RunState.QUEUED) == 19, states


def _states(engine: Engine, runs: list[Any]) -> list[RunState]:
    with engine.connect() as conn:
        return [get_run(conn, r.id).state for r in runs]


class TestWakeUps:
    def test_a_started_run_wakes_an_idle_worker_at_once(self, engine: Engine,
                                                       database_url: str) -> None:
        """The fallback poll is 30 s: only the NOTIFY at commit can make this quick."""
        app = App(database_url=database_url)

        @app.workflow("quick", version="1")
        def quick(job: ClaimedRun[Any]) -> None:
            return None

        with running(app, poll_seconds=30):
            time.sleep(0.2)  # let the worker go idle (its claim found nothing)
            started = time.monotonic()
            with engine.begin() as conn:
                run = app.start_run(conn, quick, idempotency_key="k")
            run_in(engine, run.id, "done", timeout=5)
            latency = time.monotonic() - started
        assert latency < 2.0, latency

    def test_a_run_due_later_is_stepped_at_its_time(self, engine: Engine,
                                                   database_url: str) -> None:
        """No NOTIFY announces a timer: the worker sleeps until the due time it queried."""
        app = App(database_url=database_url)
        stepped: list[float] = []

        @app.workflow("timer", version="1")
        def timer(job: ClaimedRun[Any]) -> None:
            stepped.append(time.monotonic())
            if len(stepped) == 1:
                job.transition("waiting", step="sleeping", reason="wake me in 1 s",
                               wake_at=timedelta(seconds=1))

        with running(app, poll_seconds=30):
            with engine.begin() as conn:
                run = app.start_run(conn, timer, idempotency_key="k")
            run_in(engine, run.id, "done", timeout=6)
        assert 0.9 < stepped[1] - stepped[0] < 2.5, stepped

    def test_start_run_notifies_at_commit_only_and_once_per_key(self, engine: Engine,
                                                               database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("wf", version="1")
        def step(job: ClaimedRun[Any]) -> None:
            return None

        with psycopg.connect(database_url, autocommit=True) as listener:
            listener.execute(f"LISTEN {channel(app.settings)}")
            with engine.begin() as conn:
                conn.execute(declare_idle("w-1", 60))  # a worker waits: commits notify
            with engine.begin() as conn:
                app.start_run(conn, step, idempotency_key="k")
                assert list(listener.notifies(timeout=0.2, stop_after=1)) == []  # not before
            heard = list(listener.notifies(timeout=2, stop_after=1))
            assert [(n.channel, n.payload) for n in heard] == [("outboxkit_runs", "wf")]
            with engine.begin() as conn:
                app.start_run(conn, step, idempotency_key="k")  # the same key: no new run
            assert list(listener.notifies(timeout=0.3, stop_after=1)) == []


class TestProbes:
    def test_readyz_and_metrics_answer(self, engine: Engine, database_url: str) -> None:
        app = App(database_url=database_url)

        @app.workflow("wf", version="1")
        def step(job: ClaimedRun[Any]) -> None:
            return None

        port = free_port()
        with running(app, http_port=port):
            with engine.begin() as conn:
                run = app.start_run(conn, step, idempotency_key="k")
            run_in(engine, run.id, "done")
            assert get(port, "/readyz") == (200, "ready\n")
            assert get(port, "/healthz") == (200, "ok\n")
            # The pool thread counts its step's outcome before the loop takes the step out
            # of the in-flight gauge: a scrape between the two sees both (a test under load
            # saw it), so wait for the two.
            metrics = wait_for(lambda: _metrics_with(port, 'outcome="done"', "in_flight 0.0"),
                               what="the step done and none in flight in /metrics")
        assert 'outboxkit_worker_steps_total{outcome="done",workflow="wf@1"} 1.0' in metrics
        assert 'outboxkit_worker_step_seconds_count{workflow="wf@1"} 1.0' in metrics
        assert "outboxkit_worker_steps_in_flight 0.0" in metrics


def get(port: int, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        return reply.status, reply.read().decode()


def _metrics_with(port: int, *needles: str) -> str | None:
    body = get(port, "/metrics")[1]
    return body if all(needle in body for needle in needles) else None

