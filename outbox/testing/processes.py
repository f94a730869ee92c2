"""Small process and port helpers shared by the local PostgreSQL and Kafka services."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import socket
import time
from pathlib import Path

from outbox.errors import ServiceError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_port() -> int:
    """A free TCP port on 127.0.0.1 for a server that binds it only seconds later (a JVM, a
    PostgreSQL start): picked below the kernel's ephemeral range, so that no outgoing
    connection of any process takes it meanwhile (a Kafka node once failed its start-up that
    way, "Address already in use", while the test suite ran), and at random, so that
    processes starting services side by side do not pick the same one."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()  # a crowded range: any free port, as before


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768
    return low if low > 11_000 else 32_768


def ensure_port_free(port: int, what: str, flag: str) -> None:
    """Fail fast, naming the port and the flag to change it, instead of hanging later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the servers themselves: connections in TIME_WAIT from a previous run of the
        # same service must not count as "in use", only a live listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ServiceError(
                    f"port {port} on 127.0.0.1 is already in use, so {what} cannot listen there; "
                    f"stop what uses it or choose another port with {flag}"
                ) from exc
            raise


def port_open(port: int, timeout: float = 0.5) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists"; reap it if it is ours.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def stop_pid(pid: int, *, grace_s: float = 20.0) -> bool:
    """SIGTERM *pid*, then SIGKILL after *grace_s*. True if it had to be killed."""
    if not pid_alive(pid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return False
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True
