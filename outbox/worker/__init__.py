"""The agent worker: users register step functions on an :class:`outbox.App`; this runs them.

``outbox worker module:app`` on the command line, or in-process::

    from outbox.worker import run_worker
    run_worker(app, stop=threading.Event())

* :func:`run_worker` / :func:`run_worker_async`: claim runs of the app's workflows and step
  them, woken by NOTIFY, until stopped (docs/worker.md says what each step commits).
* :class:`WorkerSettings`: ``OUTBOXKIT_WORKER_*``.

The daemon object behind both, :class:`outbox.worker.worker.Worker`, is what ``outbox worker``
runs; it is not part of the public surface.
"""

from outbox.worker.settings import WorkerSettings
from outbox.worker.worker import run_worker, run_worker_async

__all__ = ["WorkerSettings", "run_worker", "run_worker_async"]
