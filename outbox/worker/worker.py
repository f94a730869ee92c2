"""The worker: claims runs of an :class:`~outbox.app.App`'s workflows and steps them.

One asyncio loop claims (each claim its own committed transaction, on an ``AsyncEngine``)
while fewer than ``concurrency`` steps are in flight; ``async def`` step functions run as
tasks on that loop, sync ones in a thread pool on a sync ``Engine``
(:mod:`outbox.worker.steps` says what each step commits). When every step function is sync,
each claim runs in the pool thread that then runs its step, on one connection of the sync
``Engine``, and that thread goes on claiming and stepping while runs are claimable (no event
loop round trip per step, one pool checkout per streak); the loop is told what the first
claim found as soon as it committed. Idle, it waits for a NOTIFY, the next due time or the
fallback poll (:mod:`outbox.worker.wakeup`).

Like the relay and the consumer runner it serves ``/healthz``, ``/readyz`` and ``/metrics``
(:class:`~outbox.runtime.Lifecycle`), waits out a database outage with one warning per
outage (not ready meanwhile), and stops gracefully: no new claims, in-flight steps get
``shutdown_timeout_seconds`` to finish; one that does not is abandoned, nothing of it
commits (the process exits; an async step is cancelled and rolled back) and its lease is
left to expire, after which another worker resumes the run from its last commit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.app import App, Step
from outbox.backoff import Backoff
from outbox.db.dsn import redact
from outbox.db.engines import async_engine_for, engine_for
from outbox.db.execution import options, run_plan, run_plan_async
from outbox.errors import ConfigurationError
from outbox.runs import wakeups
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import Claim, Run, claim_attempt_plan
from outbox.runs.wakeups import channel
from outbox.runs.workflows import register_plan
from outbox.runtime.lifecycle import Lifecycle
from outbox.runtime.metrics import MetricFamilies
from outbox.worker import steps
from outbox.worker.settings import WorkerSettings
from outbox.worker.wakeup import NEXT_DUE, Listener

log = logging.getLogger(__name__)
T = TypeVar("T")

# Reconnect pauses while the database is down: 0.2 s doubling up to 5 s (no log per attempt).
OUTAGE = Backoff(base=0.2, cap=5.0)
# Pauses between tries of wakeups.settled after declaring idle: a transaction that started a
# run and is still open (10 ms doubling, at most 1 s; the NOTIFY covers every later one).
SETTLE = Backoff(base=0.01, cap=1.0)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class WorkerMetrics:
    """``outboxkit_worker_*``: steps by workflow and outcome, their duration, in flight."""

    def __init__(self) -> None:
        families = MetricFamilies("worker")
        self.registry = families.registry
        self.steps = families.counter("steps_total", "Steps by workflow@version and outcome.",
                                      ["workflow", "outcome"])
        self.duration = families.histogram("step_seconds", "Duration of a step (function "
                                           "and commit).", STEP_BUCKETS, ["workflow"])
        self.in_flight = families.gauge("steps_in_flight", "Steps running now.")
        self.ready = families.gauge("ready", "1 while the worker can reach the database.")


class Worker:
    """Runs *app*'s workflows until stopped: :meth:`run` blocks, :meth:`run_async` awaits."""

    def __init__(self, app: App, settings: WorkerSettings | None = None) -> None:
        if not app.workflows:
            raise ConfigurationError("the app has no workflows: register step functions with "
                                     "@app.workflow(name, version=...) before running a worker")
        self.app = app
        self.settings = settings or WorkerSettings()
        self.url = self.settings.resolved_database_url(app.database_url)
        if not self.url:
            raise ConfigurationError("no database URL: set OUTBOXKIT_WORKER_DATABASE_URL (or "
                                     "OUTBOXKIT_DATABASE_URL), pass App(database_url=...) or "
                                     "--database-url")
        self.name = self.settings.name
        self.metrics = WorkerMetrics()
        self.lifecycle = Lifecycle("worker", self.name, log=log, ready_gauge=self.metrics.ready,
                                   backoff=OUTAGE,
                                   stuck_after_s=self.settings.poll_seconds + 60.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poke: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failures = 0
        self._listener: Listener | None = None
        self._idle = False  # declared in run_workers: commits NOTIFY while it is
        self._declared_at = 0.0
        self._settling = 0  # >0: declared idle, and the claim once more not yet safe (tries)
        self._workflows = app.workflows
        self.abandoned = False
        """True once a step was abandoned at shutdown (a sync one may still run in its thread)."""

    # --- control ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop claiming and let in-flight steps finish (thread- and signal-safe)."""
        self.lifecycle.stop()
        self._wake()

    def _wake(self) -> None:
        loop, poke = self._loop, self._poke
        if loop is not None and poke is not None and not loop.is_closed():
            # RuntimeError: the loop closed in between, so nothing is left to wake
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(poke.set)

    @property
    def ready(self) -> bool:
        """What ``/readyz`` says: the database answered the last claim, and not stopping."""
        return self.lifecycle.ready()

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up (NOTIFYs wake the worker at once)."""
        return self._listener is not None and self._listener.connected.is_set()

    @property
    def http_port(self) -> int | None:
        """The port ``/metrics`` and the probes listen on (``None``: not serving)."""
        return self.lifecycle.http_port

    def run(self, stop: threading.Event | None = None) -> int:
        """Run until :meth:`stop` (or *stop* is set); 0, or 1 if a step was abandoned."""
        watcher = None
        if stop is not None:
            watcher = threading.Thread(target=self._watch, args=(stop,), daemon=True,
                                       name="worker-stop")
            watcher.start()
        return asyncio.run(self.run_async())

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(0.1) and not self.lifecycle.stopping.is_set():
            pass
        self.stop()

    async def run_async(self, stop: asyncio.Event | None = None) -> int:
        """:meth:`run` in the running event loop; *stop* (an ``asyncio.Event``) stops it."""
        self._loop, self._poke = asyncio.get_running_loop(), asyncio.Event()
        if self.lifecycle.stopping.is_set():
            self._poke.set()
        settings = self.settings
        registered = self.app._registered()
        self._workflows = self.app.workflows  # what every claim passes (sorted once)
        answers = settings.database_answer_timeout_seconds or None
        async_engine = async_engine_for(
            self.url, answer_timeout_s=answers,
            # claims and the due-time query, plus one per async step in flight
            # (two for an agent's turn: its autocommit connection and its transactions)
            pool_size=2 + settings.concurrency * (
                2 if any(s.drives for s in registered)
                else 1 if any(s.is_async for s in registered) else 0),
            max_overflow=2, pool_pre_ping=True)
        sync_engine: Engine | None = None
        pool = None
        if any(not s.is_async for s in registered):
            sync_engine = engine_for(self.url, pool_size=settings.concurrency, max_overflow=2,
                                     pool_pre_ping=True, answer_timeout_s=answers)
            pool = concurrent.futures.ThreadPoolExecutor(settings.concurrency,
                                                         thread_name_prefix="worker-step")
        self._listener = Listener(self.url, channel(self.app.settings), self._poke.set,
                                  lambda: self.lifecycle.is_ready)
        background = [asyncio.create_task(self._listener.run(), name="worker-listen")]
        if stop is not None:
            background.append(asyncio.create_task(self._stop_on(stop), name="worker-stop"))
        self.lifecycle.serve_http(settings.http_host, settings.http_port, self.metrics.registry)
        log.info("worker %s starting: %s, concurrency %d, database %s", self.name,
                 ", ".join(s.name for s in registered), settings.concurrency,
                 redact(self.url), extra={"event": "worker.start"})
        try:
            await self._dispatch(async_engine, sync_engine, pool)
            if self._idle:
                # Best effort (the database may be down): a declaration left behind expires.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._declare(async_engine, idle=False), 2.0)
            return await self._drain()
        finally:
            # Cancelled or raised out of the loop (no stop() on the way): the claim threads
            # must not go on claiming after this worker is gone.
            self.lifecycle.stop()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if self._tasks and not self.abandoned:
                # Cancelled, so not drained: the steps in flight finish (no more claims) and
                # hand their connections back before the engines go, within the grace.
                await asyncio.wait(set(self._tasks),
                                   timeout=self.settings.shutdown_timeout_seconds)
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            await async_engine.dispose()
            if sync_engine is not None:
                sync_engine.dispose()
            self.lifecycle.close()

    async def _stop_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stop()

    # --- the loop --------------------------------------------------------------------------
    async def _dispatch(self, engine: AsyncEngine, sync_engine: Engine | None,
                        pool: concurrent.futures.Executor | None) -> None:
        assert self._poke is not None
        registered = False
        # Every step function sync: each claim and its step run in one pool thread, on one
        # connection of the sync engine (no event loop round trip, no second checkout).
        threaded = sync_engine is not None and not any(s.is_async
                                                       for s in self.app._registered())
        while not self.lifecycle.stopping.is_set():
            self.lifecycle.beat()
            self._poke.clear()  # before looking: a NOTIFY from now on is not lost
            timeout = self.settings.poll_seconds
            try:
                if not registered:
                    await self._register(engine)
                    registered = True
                if len(self._tasks) < self.settings.concurrency:
                    if threaded:
                        assert sync_engine is not None
                        assert pool is not None
                        claimed, due, skipped = await self._claim_threaded(sync_engine, pool)
                    else:
                        claimed, due, skipped = await self._claim(engine)
                    self._recovered()
                    if claimed is not None:
                        if not threaded:
                            self._start(claimed.run, claimed.lease, engine, sync_engine, pool)
                        continue  # look for more at once
                    if skipped:
                        continue  # runs set aside by the version policy: newer ones may wait
                    again = await self._declare_idle(engine)
                    if again == 0.0:
                        continue  # a commit that did not see the declaration: claim once more
                    # A few ms late, so the run is due by the database's clock when we look.
                    timeout = timeout if due is None else max(0.0, min(timeout, due + 0.005))
                    if again is not None:
                        timeout = min(timeout, again)
                elif self._idle:
                    await self._declare(engine, idle=False)  # every slot busy: no NOTIFY needed
            except Exception as exc:
                # Never raised out of the loop: a worker that dies here dies again on restart.
                self._idle = False
                await self._outage(exc)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), timeout)

    async def _register(self, engine: AsyncEngine) -> None:
        """Record each workflow's newest version (and a retirement the code declares) in the
        database; a retirement an operator recorded stays: starting a worker never undoes it."""
        newest = {w.name: w for w in self.app.workflows}
        settings = self.app.settings
        async with engine.begin() as conn:
            for workflow in newest.values():
                await run_plan_async(conn, register_plan(workflow, keep_retirement=True),
                                     settings)
            await conn.execute(wakeups.forget_dead(), execution_options=options(settings))

    async def _claim(self, engine: AsyncEngine) -> tuple[Claim | None, float | None, int]:
        """A claimed run; or none and the seconds until the next run is due (``None``: no
        timer pending), read in the claim's transaction: both see the same ``now()``, so a
        run due by then is claimed and one due after it is counted, none falls in between.
        Last, how many runs the version policy moved to needs-human on the way."""
        settings = self.app.settings
        async with engine.begin() as conn:
            attempt = await run_plan_async(conn, claim_attempt_plan(
                worker=self.name, lease_seconds=self.settings.lease_seconds,
                workflows=self._workflows, settings=settings), settings)
            if attempt.claim is not None or attempt.skipped:
                return attempt.claim, None, attempt.skipped
            due = (await conn.execute(NEXT_DUE, execution_options=options(settings))).scalar()
            return None, None if due is None else float(due), 0

    async def _claim_threaded(self, engine: Engine, pool: concurrent.futures.Executor
                              ) -> tuple[Claim | None, float | None, int]:
        """:meth:`_claim` in a pool thread on the sync *engine*; a claimed run's step then runs
        in that thread on the claim's connection (its task is started here). What the claim
        found is told back as soon as it committed, so the loop claims on meanwhile."""
        loop = asyncio.get_running_loop()
        told: asyncio.Future[tuple[Claim | None, float | None, int, Step | None]] = \
            loop.create_future()

        def tell(result: Any, error: BaseException | None) -> None:
            if told.done():  # the loop stopped waiting (cancelled)
                return
            if error is not None:
                told.set_exception(error)
            else:
                told.set_result(result)

        def tell_loop(result: Any, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(tell, result, error)

        work = loop.run_in_executor(pool, self._claim_and_step, engine, tell_loop)
        try:
            claimed, due, skipped, step = await told
        except Exception:
            # Its connection back in the pool before the loop may dispose of it (waited for,
            # not awaited: the claim's error is the one to handle, not the thread's).
            await asyncio.wait({work})
            raise
        if claimed is None:
            await asyncio.wait({work})  # the same: nothing else waits for this thread
        else:
            assert step is not None
            # with a run claimed, the thread goes on stepping; it returns the last outcome
            self._track(step.name, claimed.run, work, counted=True)
        return claimed, due, skipped

    def _claim_and_step(self, engine: Engine,
                        tell: Callable[[Any, BaseException | None], Any]) -> steps.Outcome | None:
        """In a pool thread: claim (committed), :func:`tell` the loop what it found, then run
        the claimed run's step on the same connection; and go on claiming and stepping there
        while runs are claimable and the worker is not stopping (no event loop round trip
        per step: the loop learns of the first claim only). The last step's outcome;
        ``None``: nothing claimed. A later claim that fails ends the thread quietly: the
        loop's next claim meets the same error and says what it is."""
        settings = self.app.settings
        try:
            conn = engine.connect()
        except Exception as exc:  # the claim's: the loop's outage handling says what
            tell(None, exc)
            return None
        except BaseException as exc:
            tell(None, RuntimeError(f"the claim was interrupted by {type(exc).__name__}"))
            raise
        outcome: steps.Outcome | None = None
        first = True
        with conn:
            while True:
                try:
                    with conn.begin():
                        attempt = run_plan(conn, claim_attempt_plan(
                            worker=self.name, lease_seconds=self.settings.lease_seconds,
                            workflows=self._workflows, settings=settings), settings)
                        due = None
                        if first and attempt.claim is None and not attempt.skipped:
                            due = conn.execute(NEXT_DUE, execution_options=options(settings)
                                               ).scalar()
                    claimed = attempt.claim
                    step = None if claimed is None else self.app._step_for(claimed.run)
                except BaseException as exc:
                    if first:
                        tell(None, exc if isinstance(exc, Exception) else RuntimeError(
                            f"the claim was interrupted by {type(exc).__name__}"))
                    elif isinstance(exc, Exception):
                        # The loop's own next claim meets it and says what it is; an outage
                        # makes the worker not ready at once.
                        log.debug("a claim after a step failed: %r", exc)
                        return "db_unavailable" if steps.is_unavailable(exc) else outcome
                    if isinstance(exc, Exception):
                        return outcome
                    raise
                if first:
                    tell((claimed, None if due is None else float(due), attempt.skipped,
                          step), None)
                    first = False
                if claimed is None or step is None:
                    return outcome
                started = time.perf_counter()
                outcome = steps.run_sync(step, claimed.run, claimed.lease, engine,
                                         settings=settings, actor=self.name, conn=conn)
                self._count(step.name, outcome, time.perf_counter() - started)
                if (outcome in ("db_unavailable", "error") or conn.invalidated
                        or self.lifecycle.stopping.is_set()):
                    return outcome

    async def _declare_idle(self, engine: AsyncEngine) -> float | None:
        """Say this worker waits for runs (the runs' wake-ups NOTIFY only while one does), or
        renew that. Only while LISTENing: a NOTIFY nobody hears would cost every commit for
        nothing. Returns in how many seconds to claim once more (``None``: no need): 0 once
        every transaction that may have missed the new declaration has ended (so the claim
        sees its run), a short pause while one is still open (:func:`wakeups.settled`)."""
        if not self.listening:
            return None
        if not self._idle or time.monotonic() - self._declared_at >= self.settings.poll_seconds:
            started = not self._idle
            await self._declare(engine, idle=True)
            self._settling = 1 if started else self._settling
        if not self._settling:
            return None
        # Autocommit: the server takes and drops the exclusive lock within the one statement
        # (inside a transaction it would be held until our COMMIT came, while wake-ups wait).
        async with engine.connect() as opened:
            conn = await opened.execution_options(isolation_level="AUTOCOMMIT")
            settled = (await conn.execute(wakeups.settled(self.app.settings),
                                          execution_options=options(self.app.settings))).scalar()
        if settled:
            self._settling = 0
            return 0.0
        self._settling += 1
        return SETTLE.delay(self._settling - 1)

    async def _declare(self, engine: AsyncEngine, *, idle: bool) -> None:
        # Renewed at least every 2 poll_seconds while idle (the wait never exceeds one).
        ttl = 2 * self.settings.poll_seconds + 10.0
        statement = (wakeups.declare_idle(self.name, ttl) if idle
                     else wakeups.declare_busy(self.name))
        async with engine.begin() as conn:
            await conn.execute(statement, execution_options=options(self.app.settings))
        self._idle, self._declared_at = idle, time.monotonic()
        if not idle:
            self._settling = 0

    def _start(self, run: Run, lease: Lease, engine: AsyncEngine, sync_engine: Engine | None,
               pool: concurrent.futures.Executor | None) -> None:
        step = self.app._step_for(run)
        settings, name = self.app.settings, self.name
        work: Awaitable[steps.Outcome]
        if step.drives:
            work = steps.run_driven(step, run, lease, engine, settings=settings)
        elif step.is_async:
            work = steps.run_async(step, run, lease, engine, settings=settings, actor=name)
        else:
            assert sync_engine is not None
            assert pool is not None
            work = asyncio.get_running_loop().run_in_executor(pool, functools.partial(
                steps.run_sync, step, run, lease, sync_engine, settings=settings, actor=name))
        self._track(step.name, run, work)

    def _track(self, workflow: str, run: Run, work: Awaitable[steps.Outcome | None], *,
               counted: bool = False) -> None:
        """Run *work* as a task the drain waits for; *counted*: it counts its steps itself
        (:meth:`_claim_and_step`, which may run several)."""
        task = asyncio.create_task(self._timed(workflow, work, counted),
                                   name=f"step-{run.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _timed(self, workflow: str, work: Awaitable[steps.Outcome | None],
                     counted: bool) -> None:
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        outcome: str | None = "error"
        try:
            outcome = await work
        except asyncio.CancelledError:
            raise
        except BaseException:  # a SystemExit from a step must not end the worker
            log.exception("a step of %s failed unexpectedly; its lease expires", workflow,
                          extra={"event": "worker.step_error", "workflow": workflow})
        finally:
            self.metrics.in_flight.dec()
            if not counted and outcome is not None:
                self._count(workflow, outcome, time.perf_counter() - started)
            if outcome == "db_unavailable":
                self.lifecycle.set_ready(False, "database unavailable")
            if self._poke is not None:
                self._poke.set()  # a slot is free

    def _count(self, workflow: str, outcome: str, seconds: float) -> None:
        # Thread-safe (prometheus_client locks): the pool threads count their own steps.
        self.metrics.steps.labels(workflow, outcome).inc()
        self.metrics.duration.labels(workflow).observe(seconds)

    async def _outage(self, exc: BaseException) -> None:
        """Wait before trying again; the first failure of an outage is its one log line.

        An outage, a read-only server (a failover not finished) or a statement timeout is
        waited out; any other error too, but logged with its traceback: it is a bug or a
        misconfiguration, and dying would only repeat it after every restart."""
        self._failures += 1
        if self._failures == 1:
            reason = redact((str(exc).splitlines() or [type(exc).__name__])[0])
            if steps.is_unavailable(exc):
                cause = f"database unavailable ({reason}); waiting for it"
            else:
                log.error("worker %s: claiming failed unexpectedly (%s: %s); trying again with "
                          "a growing pause", self.name, type(exc).__name__, reason,
                          exc_info=exc, extra={"event": "worker.claim_error"})
                cause = f"claiming fails ({type(exc).__name__}); trying again"
            self.lifecycle.set_ready(False, cause)
        assert self._poke is not None
        self._poke.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._poke.wait(), OUTAGE.delay(self._failures))

    def _recovered(self) -> None:
        if self._failures or not self.lifecycle.is_ready:
            self._failures = 0
            self.lifecycle.set_ready(True)

    async def _drain(self) -> int:
        """Let in-flight steps finish within the grace period; 1 if some were abandoned."""
        if not self._tasks:
            return 0
        grace = self.settings.shutdown_timeout_seconds
        log.info("worker %s stopping: waiting up to %.0f s for %d in-flight steps", self.name,
                 grace, len(self._tasks), extra={"event": "worker.stopping"})
        _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
        if not pending:
            return 0
        log.warning("worker %s: %d steps did not finish within %.0f s; abandoned: an async one "
                    "is cancelled and rolls back; a sync one's thread cannot be stopped, so "
                    "until the process exits it may still commit (fencing keeps it single); "
                    "unless it does, its lease expires and another worker resumes the run",
                    self.name, len(pending), grace, extra={"event": "worker.abandoned"})
        self.abandoned = True
        for task in pending:
            task.cancel()  # an async step's transaction rolls back; a thread cannot be stopped
        await asyncio.wait(pending, timeout=1.0)
        return 1


def run_worker(app: App, *, settings: WorkerSettings | None = None,
               stop: threading.Event | None = None) -> int:
    """Run *app*'s workflows until *stop* is set; blocks. Returns 0, or 1 if a step had to
    be abandoned at shutdown. Installs no signal handlers (``outbox worker`` does)."""
    return Worker(app, settings).run(stop)


async def run_worker_async(app: App, *, settings: WorkerSettings | None = None,
                           stop: asyncio.Event | None = None) -> int:
    """:func:`run_worker` in the running event loop, until *stop* is set."""
    return await Worker(app, settings).run_async(stop)

