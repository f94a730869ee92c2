"""Running the `outbox` command line as a user does: a subprocess with a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys

from sqlalchemy import Connection, text


def outbox(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return subprocess.run([sys.executable, "-m", "outbox.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, **env}, check=False)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The error a command printed, asserting it is a single line."""
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def refuse(conn: Connection, row_id: int, *, error: str, blocking: bool = False) -> None:
    """Record outbox row *row_id* as refused by Kafka, as the relay does (a copy in
    outbox_failures)."""
    conn.execute(text(
        "INSERT INTO outboxkit.outbox_failures (id, message_id, topic, key, lane, message_type,"
        " payload, headers, run_id, created_at, state, blocking, error)"
        " SELECT id, message_id, topic, key, lane, message_type, payload, headers, run_id,"
        " created_at, 'failed', :blocking, :error FROM outboxkit.outbox_messages WHERE id = :id"),
        {"id": row_id, "blocking": blocking, "error": error})
