"""`make demo-agent` runs as written and ends with its invariants holding."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_agent_demo_resumes_the_killed_run_without_asking_the_model_again(
    database_url: str, kafka_bootstrap: str
) -> None:
    # The demo makes its own topic and consumer group; the database is this test's own.
    env = {**os.environ, "OUTBOXKIT_DATABASE_URL": database_url,
           "OUTBOXKIT_KAFKA_BOOTSTRAP": kafka_bootstrap, "COLUMNS": "200"}
    env.pop("OUTBOXKIT_FAILPOINTS", None)
    demo = subprocess.Popen([sys.executable, str(ROOT / "examples" / "demo_agent.py")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = demo.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGINT)  # the demo stops the processes it started, then exits
        out, err = demo.communicate(timeout=60)
    assert demo.returncode == 0, out + err
    assert "worker killed (SIGKILL) after committing a model response" in out, out
    # The restarted worker took the killed run over from its last committed model response.
    assert re.search(r"running -> running +model-response:\d+ +lease expired, resumed", out), out
    assert "runs done: 3 of 3" in out, out
    assert "model requests: 9 for 9 steps; steps asked twice: 0" in out, out
    assert "reorder messages committed: 3 for 3 runs" in out, out
    assert "orders at the supplier: 3 for 3 runs, repeated POSTs: 0" in out, out
    assert out.count("reordered it from our supplier (their order ORD-") == 3, out
    assert "INVARIANT FAILED" not in out, out
    assert "all invariants hold" in out, out
