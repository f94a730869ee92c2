"""Running the `outbox` command line as a user types it, in this process (click's CliRunner:
a Python process per command cost more than most of these tests), with no OUTBOXKIT_
variable but the ones given. test_outbox_cli.py runs the command as a process of its own."""

from __future__ import annotations

import os
from dataclasses import dataclass

from click.testing import CliRunner
from sqlalchemy import Connection, text

from outbox.cli.main import main


@dataclass
class Ran:
    """What a command left: its exit status and output, named as subprocess names them."""

    returncode: int
    stdout: str
    stderr: str


def outbox(*args: str, **env: str) -> Ran:
    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("OUTBOXKIT_")}
    result = CliRunner().invoke(main, list(args), env={**unset, **env})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # A user would see this traceback: it fails the test as itself, not as a wrong line.
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


def one_line(result: Ran) -> str:
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
