"""The state a long-running outboxkit process keeps: asked to stop, ready, alive, failing.

The relay and the consumer runner differ in their loops, not in this: both report readiness
(a log line when it changes, a gauge, ``/readyz``), liveness (``/healthz``: the loop went
round recently), wait out a failure with :class:`~outbox.backoff.Backoff` while staying
stoppable, and run their background jobs on one APScheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry, Gauge

from outbox.backoff import Backoff
from outbox.runtime.health import HealthServer


class Lifecycle:
    """One daemon's run state, logged through the daemon's own *log* as ``<kind>.<event>``.

    Args:
        kind: ``relay`` or ``consumer``: the first word of its log lines and events.
        name: which one (a relay id, a consumer group).
        stuck_after_s: a loop that has not gone round for this long is not alive.
        alive_while_starting: alive until the loop first goes round (start-up waits, such as
            for a topic to be created, are not a hang); otherwise the clock starts now.
    """

    def __init__(
        self,
        kind: str,
        name: str,
        *,
        log: logging.Logger,
        ready_gauge: Gauge,
        backoff: Backoff,
        stuck_after_s: float,
        alive_while_starting: bool = False,
    ) -> None:
        self.kind, self.name = kind, name
        self.stopping = threading.Event()
        self.is_ready = False
        self._log = log
        self._ready_gauge = ready_gauge
        self.backoff = backoff
        self._stuck_after_s = stuck_after_s
        self._last_beat: float | None = None if alive_while_starting else time.monotonic()
        self._failures = 0
        self._held = ""  # why a part of the daemon holds it not ready (hold/release)
        self._http: HealthServer | None = None
        self._scheduler: BackgroundScheduler | None = None

    # --- probes ---------------------------------------------------------------------------
    def ready(self) -> bool:
        """Serving: ready, not held back, and not stopping."""
        return self.is_ready and not self._held and not self.stopping.is_set()

    def healthy(self) -> bool:
        """Alive: the loop went round within ``stuck_after_s``."""
        if self._last_beat is None:
            return True
        return time.monotonic() - self._last_beat < self._stuck_after_s

    def beat(self) -> None:
        """The loop went round (or waited on something that answers): not stuck."""
        self._last_beat = time.monotonic()

    def set_ready(self, value: bool, cause: str = "") -> None:
        """Say so when readiness changes: becoming not ready is a warning that names *cause*."""
        if value != self.is_ready:
            if value:
                self._log.info("%s %s is ready", self.kind, self.name,
                               extra={"event": f"{self.kind}.ready"})
            else:
                self._log.warning("%s %s is not ready: %s", self.kind, self.name,
                                  cause or "reason unknown",
                                  extra={"event": f"{self.kind}.not_ready"})
        self.is_ready = value
        self._ready_gauge.set(1 if value and not self._held else 0)

    def hold(self, cause: str) -> None:
        """Not ready because of *cause*, whatever the loop's own successes say, until
        :meth:`release` (a watchdog's verdict must not be undone by the next batch, nor
        undo a database failure's)."""
        if not self._held:
            self._log.warning("%s %s is not ready: %s", self.kind, self.name, cause,
                              extra={"event": f"{self.kind}.not_ready"})
        self._held = cause
        self._ready_gauge.set(0)

    def release(self) -> None:
        if self._held:
            self._held = ""
            if self.is_ready:
                self._log.info("%s %s is ready", self.kind, self.name,
                               extra={"event": f"{self.kind}.ready"})
            self._ready_gauge.set(1 if self.is_ready else 0)

    # --- failures -------------------------------------------------------------------------
    def succeeded(self) -> None:
        """The work went through: ready, and the next failure waits the shortest delay."""
        self._failures = 0
        self.set_ready(True)

    def back_off(self, reason: str) -> None:
        """Wait before trying again, longer after each failure in a row; a stop cuts it short."""
        self._failures += 1
        delay = self.backoff.delay(self._failures)
        self._log.warning("%s; retrying in %.2f s", reason, delay,
                          extra={"event": f"{self.kind}.backoff"})
        self.stopping.wait(delay)

    # --- the process's parts --------------------------------------------------------------
    def stop(self) -> None:
        self.stopping.set()

    def serve_http(self, host: str, port: int, registry: CollectorRegistry) -> None:
        """``/metrics``, ``/healthz`` and ``/readyz`` on *port* (0: none)."""
        if port:
            self._http = HealthServer(host, port, registry, self.healthy, self.ready,
                                      name=f"{self.kind}-http")
            self._http.start()

    @property
    def http_port(self) -> int | None:
        """The port it listens on (the one asked for, or the one the system chose)."""
        return None if self._http is None else self._http.port

    def scheduler(self) -> BackgroundScheduler:
        """A scheduler for background jobs: never two runs of a job at once, and a run missed
        while the process was busy happens once, late, rather than being skipped or repeated."""
        self._scheduler = BackgroundScheduler(
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
        )
        return self._scheduler

    def job(self, fn: Callable[[], object], describe: Callable[[BaseException], str] = str
            ) -> Callable[[], None]:
        """*fn* as a background job: a failure is a warning, and the job runs again later."""

        def run() -> None:
            try:
                fn()
            except Exception as exc:
                self._log.warning("%s job %s failed: %s", self.kind,
                                  getattr(fn, "__name__", fn), describe(exc),
                                  extra={"event": f"{self.kind}.job_failed"})

        return run

    def stop_background(self) -> None:
        """Stop the scheduler (first, so no job starts while the rest shuts down)."""
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)

    def close(self) -> None:
        """Stop serving HTTP and say the daemon stopped (last: the probes answer until the
        process is done)."""
        if self._http is not None:
            self._http.stop()
            self._http = None
        self._log.info("%s %s stopped", self.kind, self.name, extra={"event": f"{self.kind}.stop"})
