"""outbox.testing.toxiproxy against the real toxiproxy-server (built by scripts/bootstrap): a
missing binary is a failure here, not a skip. Each toxic is checked by its effect on a real
TCP connection through the proxy (an echo server of the test's own, and PostgreSQL)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox.db.dsn import libpq_url
from outbox.errors import MissingToolError
from outbox.testing import toxiproxy
from outbox.testing.toxiproxy import Client, Server, ToxiproxyError


@pytest.fixture
def api(toxiproxy_server: Server) -> Iterator[Client]:
    client = toxiproxy_server.client
    try:
        yield client
    finally:
        for name in client.proxies():
            client.delete(name)


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    """A TCP server that sends back whatever it receives, on a free port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def connect(proxy: toxiproxy.Proxy, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout_s)


def round_trip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_a_proxy_forwards_on_the_port_the_server_chose(api: Client, echo: str) -> None:
    assert api.version()  # "git" when built by go install (no release ldflags)
    proxy = api.create("echo", echo)
    assert proxy.port > 0
    assert proxy.upstream == echo
    assert api.get("echo") == proxy
    with connect(proxy) as sock:
        assert round_trip(sock, b"hello") == b"hello"


def test_a_disabled_proxy_closes_its_connections_and_refuses_new_ones(
    api: Client, echo: str
) -> None:
    proxy = api.create("cut", echo)
    with connect(proxy) as sock:
        assert round_trip(sock, b"a") == b"a"
        assert not api.disable("cut").enabled
        sock.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""  # closed by the proxy
    with pytest.raises(ConnectionRefusedError):
        connect(proxy).close()
    api.enable("cut")
    with connect(proxy) as sock:
        assert round_trip(sock, b"back") == b"back"


def test_latency_with_jitter_delays_each_round_trip(api: Client, echo: str) -> None:
    proxy = api.create("slow", echo)
    assert api.latency("slow", 300, 100) == "latency_downstream"
    with connect(proxy) as sock:
        started = time.monotonic()
        assert round_trip(sock, b"x") == b"x"
        took = time.monotonic() - started
    assert 0.19 <= took <= 2.0, took
    assert [t["type"] for t in api.toxics("slow")] == ["latency"]


def test_bandwidth_caps_the_rate(api: Client, echo: str) -> None:
    proxy = api.create("thin", echo)
    api.bandwidth("thin", 64)  # KB/s back to the client
    payload = b"z" * 128 * 1024
    with connect(proxy, timeout_s=20) as sock:
        started = time.monotonic()
        assert round_trip(sock, payload) == payload
        took = time.monotonic() - started
    assert took >= 1.5, took  # 128 KB at 64 KB/s: about 2 s, unthrottled a millisecond


def test_a_zero_timeout_leaves_the_connection_open_and_silent(api: Client, echo: str) -> None:
    proxy = api.create("halfopen", echo)
    with connect(proxy) as sock:
        assert round_trip(sock, b"1") == b"1"
        api.timeout("halfopen", 0)
        sock.sendall(b"2")
        sock.settimeout(1.5)
        with pytest.raises(TimeoutError):  # neither data nor a close: half-open
            sock.recv(1)


def test_a_timeout_closes_the_connection_after_it(api: Client, echo: str) -> None:
    proxy = api.create("closing", echo)
    api.timeout("closing", 500, stream="upstream")
    with connect(proxy) as sock:
        sock.sendall(b"x")
        sock.settimeout(5)
        started = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""
        assert time.monotonic() - started < 4


def test_reset_peer_resets_the_connection(api: Client, echo: str) -> None:
    proxy = api.create("rst", echo)
    api.reset_peer("rst", 0)
    with connect(proxy) as sock:
        sock.settimeout(5)
        sock.sendall(b"x")
        with pytest.raises(ConnectionResetError):
            sock.recv(1)


def test_limit_data_closes_after_so_many_bytes(api: Client, echo: str) -> None:
    proxy = api.create("limited", echo)
    api.limit_data("limited", 10)
    with connect(proxy) as sock:
        sock.settimeout(5)
        got = round_trip(sock, b"0123456789abcdefghij")
    assert got == b"0123456789", got


def test_reset_removes_every_toxic_and_enables_every_proxy(api: Client, echo: str) -> None:
    api.create("p1", echo)
    api.create("p2", echo)
    api.latency("p1", 1000)
    api.disable("p2")
    api.reset()
    assert api.toxics("p1") == []
    assert api.get("p2").enabled
    with connect(api.get("p1")) as sock:
        started = time.monotonic()
        assert round_trip(sock, b"x") == b"x"
        assert time.monotonic() - started < 0.5
    with pytest.raises(ToxiproxyError, match="404"):
        api.remove_toxic("p1", "latency_downstream")


def test_the_api_says_what_it_refused(api: Client, echo: str) -> None:
    api.create("twice", echo)
    with pytest.raises(ToxiproxyError, match="409"):
        api.create("twice", echo)
    with pytest.raises(ToxiproxyError, match="404"):
        api.get("nobody")


def test_postgresql_through_a_proxy_and_cut_off(api: Client, database_url: str) -> None:
    proxied = api.front("pg", libpq_url(database_url))
    with psycopg.connect(proxied, connect_timeout=5) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        api.disable("pg")
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    api.enable("pg")
    with psycopg.connect(proxied, connect_timeout=5) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_missing_binary_names_the_install_command(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("OUTBOXKIT_TOXIPROXY_BIN", str(tmp_path / "nothing-here"))
    with pytest.raises(MissingToolError, match=r"go install github\.com/Shopify/toxiproxy"):
        toxiproxy.executable()
    with pytest.raises(MissingToolError):
        Server(tmp_path).start()


def test_the_server_is_stopped_by_its_pid(tmp_path: Path) -> None:
    srv = Server(tmp_path)
    srv.start()
    assert srv.popen is not None
    pid = srv.popen.pid
    assert (tmp_path / "toxiproxy.pid").read_text().strip() == str(pid)
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (tmp_path / "toxiproxy.pid").exists()
