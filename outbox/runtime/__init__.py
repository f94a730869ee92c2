"""What outboxkit's long-running processes share (the relay, the consumer runner).

* :class:`Lifecycle`: stop, readiness, liveness, backoff after failures, the background
  scheduler and the health server, kept the same way by every daemon.
* :class:`HealthServer`: ``/metrics``, ``/healthz`` and ``/readyz``.
* :class:`MetricFamilies`: a daemon's Prometheus metrics, in a registry of its own.
* :func:`required_database_url`: a daemon's start-up check of its connection settings.
* :func:`configure_logging`: for command-line entry points only (the library never
  configures logging); they run a daemon with :func:`outbox.cli.daemon.run_daemon`.
"""

from outbox.runtime.endpoints import required_database_url
from outbox.runtime.health import HealthServer
from outbox.runtime.lifecycle import Lifecycle
from outbox.runtime.logs import configure_logging
from outbox.runtime.metrics import MetricFamilies

__all__ = [
    "HealthServer",
    "Lifecycle",
    "MetricFamilies",
    "configure_logging",
    "required_database_url",
]
