"""`make demo-agent` runs as written and ends with its invariants holding."""

from __future__ import annotations

import os
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
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "demo_agent.py")],
                            env=env, capture_output=True, text=True, timeout=150, check=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "worker killed (SIGKILL) after committing a model response" in out, out
    assert "lease expired, resumed by" in out, out  # the restarted worker took the run over
    assert "runs done: 3 of 3" in out, out
    assert "model requests: 9 for 9 steps; steps asked twice: 0" in out, out
    assert "reorder messages committed: 3 for 3 runs" in out, out
    assert "orders at the supplier: 3 for 3 runs, repeated POSTs: 0" in out, out
    assert out.count("reordered it from our supplier (their order ORD-") == 3, out
    assert "INVARIANT FAILED" not in out, out
    assert "all invariants hold" in out, out
