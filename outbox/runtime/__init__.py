"""What outboxkit's long-running processes share (the relay, the consumer runner).

* :class:`Lifecycle`: stop, readiness, liveness, backoff after failures, the background
  scheduler and the health server, kept the same way by every daemon.
* :class:`HealthServer`: ``/metrics``, ``/healthz`` and ``/readyz``.
* :class:`MetricFamilies`: a daemon's Prometheus metrics, in a registry of its own.
* :func:`required_database_url`: a daemon's start-up check of its connection settings.
* :func:`run_daemon` and :func:`configure_logging`: for command-line entry points only (the
  library never configures logging nor installs signal handlers).
"""

from outbox.runtime.cli import EXIT_CONFIG, EXIT_FAILED, run_daemon
from outbox.runtime.endpoints import required_database_url
from outbox.runtime.health import HealthServer
from outbox.runtime.lifecycle import Lifecycle
from outbox.runtime.logs import configure_logging
from outbox.runtime.metrics import MetricFamilies

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "HealthServer",
    "Lifecycle",
    "MetricFamilies",
    "configure_logging",
    "required_database_url",
    "run_daemon",
]
