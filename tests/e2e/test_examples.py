"""The examples and the README's code run as written, so they never rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from sqlalchemy import Engine, text

from outbox.db.dsn import sqlalchemy_url
from outbox.worker import WorkerSettings, run_worker

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_ends_with_every_invariant_holding(database_url: str,
                                                     kafka_bootstrap: str) -> None:
    env = {**os.environ, "OUTBOXKIT_DATABASE_URL": database_url,
           "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap, "COLUMNS": "200"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], env=env,
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all invariants hold" in result.stdout
    # The kills really happened (by failpoint or, failing that, by hand) and were recovered.
    assert "relay killed" in result.stdout, result.stdout
    assert "consumer killed" in result.stdout, result.stdout
    assert "every run settled" in result.stdout, result.stdout
    # The supplier's timeout leaves widget-3's outcome unknown; a consumer killed while other
    # calls are in flight (16 handlers at once) may leave more: each reconciled by a query.
    reconciled = re.search(r"unknown outcomes reconciled by a status query: (\d+)", result.stdout)
    assert reconciled is not None, result.stdout
    assert int(reconciled.group(1)) >= 1, result.stdout
    assert re.search(r"widget-3 .*check:confirmed", result.stdout), result.stdout
    assert "orders at the supplier: 7 for 7 done runs" in result.stdout, result.stdout


def test_the_readme_agent_step_commits_state_and_message_together(
    engine: Engine, database_url: str
) -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## One agent step.*?```python\n(.*?)```", readme, re.S)
    assert block is not None
    code = block.group(1).replace('"postgresql+psycopg://app@db/app"',
                                  repr(sqlalchemy_url(database_url)))
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    namespace["engine"].dispose()  # type: ignore[attr-defined]

    def state() -> str:
        with engine.connect() as conn:
            return str(conn.execute(text("SELECT state FROM outboxkit.agent_runs")).scalar_one())

    assert state() == "queued"  # started, not stepped: that is the worker's job
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outboxkit.outbox_messages")).scalar() == 0
    # What `outbox worker myapp:app` does, in this process until the run has moved on.
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(namespace["app"],), daemon=True,
                              kwargs={"stop": stop, "settings": WorkerSettings(
                                  database_url=database_url, poll_seconds=0.2)})
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while state() == "queued" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(timeout=30)
    with engine.connect() as conn:
        topics = conn.execute(text("SELECT topic FROM outboxkit.outbox_messages")).scalars().all()
    assert state() == "waiting"
    assert topics == ["order.submit"]


def test_the_readme_consumer_registers_its_handler() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## An idempotent consumer.*?```python\n(.*?)```", readme, re.S)
    assert block is not None
    namespace: dict[str, object] = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)  # noqa: S102 - our README
    app = namespace["app"]
    assert list(app.topics) == ["order.submit"]  # type: ignore[attr-defined]
    assert app.group_id == "orders"  # type: ignore[attr-defined]
