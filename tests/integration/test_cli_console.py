"""`outbox console` as a user starts it: a process of its own that prints its address and
serves it; `outbox console hash-password` makes a user's entry; bad settings say what."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from console.auth import Users, hash_password
from tests.integration.cli_support import outbox


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_outbox_console_serves_its_address_until_stopped(database_url: str) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    # The console's own URL (its least-privileged role) wins over the daemons' shared one.
    env["OUTBOXKIT_CONSOLE_DATABASE_URL"] = database_url
    env["OUTBOXKIT_DATABASE_URL"] = "postgresql://nobody@127.0.0.1:1/nothing"
    with subprocess.Popen([sys.executable, "-m", "outbox.cli.main", "console", "--port",
                           str(port)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert f"http://127.0.0.1:{port}/" in line
            assert "read-only" in line  # no users configured
            _wait_for_page(f"http://127.0.0.1:{port}/runs", "Runs")
            # An open overview page: a stream that never ends by itself must not keep the
            # process from stopping.
            stream = urllib.request.urlopen(f"http://127.0.0.1:{port}/events",
                                            timeout=30)
            assert stream.readline().startswith(b"id: ")
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=20)
        stream.close()
        assert proc.stderr is not None
        errors = proc.stderr.read()
    # uvicorn shuts down gracefully, then re-raises the signal (so the exit says SIGTERM).
    assert code in (0, -signal.SIGTERM), errors
    assert "Traceback" not in errors


def _wait_for_page(url: str, text: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as page:  # noqa: S310 - loopback
                assert page.status == 200
                assert text in page.read().decode()
                return
        except OSError:
            assert time.monotonic() < deadline, "the console never answered"
            time.sleep(0.1)


def test_hash_password_prints_an_entry_the_console_accepts() -> None:
    made = outbox("console", "hash-password", "--user", "ann", "--role", "viewer",
                  "--password", "correct horse")
    assert made.returncode == 0, made.stderr
    entry = made.stdout.strip()
    assert entry.startswith("ann:viewer:scrypt$")
    assert "correct horse" not in entry
    assert Users(entry).any
    bad = outbox("console", "hash-password", "--user", "a:b", "--password", "pw")
    assert bad.returncode != 0
    assert "':'" in bad.stderr


def test_a_bad_users_setting_stops_the_console_with_one_line(database_url: str) -> None:
    ran = outbox("console", OUTBOXKIT_DATABASE_URL=database_url,
                 OUTBOXKIT_CONSOLE_USERS="ann:root:" + hash_password("pw"))
    assert ran.returncode == 2
    assert "roles are operator, viewer" in ran.stderr
    nothing = outbox("console")
    assert nothing.returncode == 2
    assert "no database" in nothing.stderr
