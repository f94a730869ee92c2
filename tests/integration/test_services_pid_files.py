"""A local broker's pid file holds its pid alone (``kill $(cat broker.pid)`` works); its
ports live beside it. A pid file in the old ``pid port controller_port`` layout, as left by
services started before, is still read, so ``start``/``status``/``stop`` keep managing them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from outbox.testing.processes import pid_alive, stop_pid


def services(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox.testing.services", "--dir", str(state),
                           *args], capture_output=True, text=True, timeout=180, check=False)


def kafka_status(state: Path) -> dict[str, object] | None:
    done = services(state, "status")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("kafka"))
    text = line.removeprefix("kafka").strip()
    return None if text == "not running" else json.loads(text)


def wait_dead(pid: int, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not pid_alive(pid)


def test_one_pid_per_pid_file_and_the_old_layout_is_still_managed(tmp_path: Path) -> None:
    state = tmp_path / "svc"
    home = state / "kafka"
    started: list[int] = []
    try:
        first = services(state, "start", "kafka")
        assert first.returncode == 0, first.stderr
        bootstrap = first.stdout.strip()
        port = int(bootstrap.rsplit(":", 1)[1])
        pid_text = (home / "broker.pid").read_text()
        pid = int(pid_text.split()[0])
        started.append(pid)  # stopped at the end whatever happens
        assert pid_text.strip().isdigit(), pid_text  # one number: the broker's pid
        assert kafka_status(state) == {"pid": pid, "bootstrap": bootstrap}
        ports = json.loads((home / "broker.json").read_text())
        assert ports["port"] == port
        controller_port = ports["controller_port"]
        # What the shell does with it: signal 0 to each number in the file, i.e. the broker.
        probe = subprocess.run(["sh", "-c", f"kill -0 $(cat {home / 'broker.pid'})"],
                               capture_output=True, text=True, timeout=30, check=False)
        assert probe.returncode == 0, probe.stderr

        # A broker started by the code before: "pid port controller_port", no ports file.
        (home / "broker.pid").write_text(f"{pid} {port} {controller_port}\n")
        (home / "broker.json").unlink()
        assert kafka_status(state) == {"pid": pid, "bootstrap": bootstrap}
        reused = services(state, "start", "kafka")
        assert reused.returncode == 0, reused.stderr
        assert reused.stdout.strip() == bootstrap
        assert kafka_status(state) == {"pid": pid, "bootstrap": bootstrap}  # not a second one
        stopped = services(state, "stop", "kafka")
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped" in stopped.stderr
        assert wait_dead(pid)
        assert not (home / "broker.pid").exists()  # no stale pid left for a later kill
        assert kafka_status(state) is None
    finally:
        for pid in started:
            stop_pid(pid, grace_s=5)
