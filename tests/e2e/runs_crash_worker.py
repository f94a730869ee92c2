"""A worker that SIGKILLs itself mid-run; driven by tests/e2e/test_runs_crash.py.

Usage: runs_crash_worker.py DATABASE_URL CALLS_FILE in-step|between
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from sqlalchemy import create_engine

from outbox.db.dsn import sqlalchemy_url
from outbox.handle import claim


def tool(calls: Path, name: str) -> dict[str, str]:
    """The outside effect: one line per real call, written before the step commits."""
    with calls.open("a") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    return {"result": f"{name}-ok"}


def main() -> None:
    url, calls, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    engine = create_engine(sqlalchemy_url(url))
    with engine.begin() as conn:
        job = claim(conn, worker="doomed", lease_seconds=1)
    assert job is not None
    with engine.begin() as conn:
        step = job.on(conn).run_step("s1", lambda: tool(calls, "s1"), checkpoint={"after": "s1"})
        if mode == "in-step":
            os.kill(os.getpid(), signal.SIGKILL)  # inside the step's transaction
    if mode == "between":
        os.kill(os.getpid(), signal.SIGKILL)  # s1 committed, s2 not started
    raise SystemExit(f"not killed? {step}")


if __name__ == "__main__":
    main()
