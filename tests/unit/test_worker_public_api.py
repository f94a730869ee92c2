"""The names outbox.worker exports, pinned."""

from __future__ import annotations

import outbox.worker


def test_the_worker_exports_its_runner_and_settings_sorted() -> None:
    assert outbox.worker.__all__ == ["WorkerSettings", "run_worker", "run_worker_async"]
    assert all(hasattr(outbox.worker, name) for name in outbox.worker.__all__)
