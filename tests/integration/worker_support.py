"""Running an outbox worker in a test: in a thread of the test process, stopped at the end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine

from outbox import App, Run
from outbox.runs.lifecycle import get_run
from outbox.worker import WorkerSettings
from outbox.worker.worker import Worker


@contextmanager
def running(app: App, **settings: Any) -> Iterator[Worker]:
    """*app*'s worker in a thread, ready and listening when this yields; stopped after."""
    worker = Worker(app, WorkerSettings(**{"poll_seconds": 30.0, **settings}))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: worker.ready and worker.listening, what="the worker to be ready")
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the worker did not stop"
    assert codes == [0]


def wait_for(condition: Callable[[], Any], *, timeout: float = 10.0, what: str = "it") -> Any:
    """*condition*'s first truthy value, checked every 10 ms; fails after *timeout*."""
    deadline = time.monotonic() + timeout
    while True:
        if value := condition():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def run_in(engine: Engine, run_id: Any, *states: str, timeout: float = 10.0) -> Run:
    """The run once it is in one of *states*."""

    def settled() -> Run | None:
        with engine.connect() as conn:
            run = get_run(conn, run_id)
        return run if run.state in states else None

    found: Run = wait_for(settled, timeout=timeout, what=f"run {run_id} to be in {states}")
    return found
