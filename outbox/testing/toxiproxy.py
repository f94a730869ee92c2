"""Toxiproxy, a real TCP fault proxy, for network fault tests: its server run as a child
process on loopback, and a small client of its HTTP API.

A proxy listens on a port of its own and forwards to an upstream (``127.0.0.1:5432``); a
client pointed at the proxy instead of the server can then be cut off (the proxy disabled:
its connections closed, new ones refused), slowed (latency, bandwidth), or left hanging on
a connection that stays open but forwards nothing (a ``timeout`` toxic of 0 ms: a
half-open connection, what a dead peer or a dropped route looks like).

The server is built from its Go module by ``scripts/bootstrap`` (see :data:`INSTALL_HINT`).
Only the server this module started is ever stopped, by its pid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from outbox.errors import MissingToolError, ServiceError
from outbox.testing.processes import free_port, pid_alive, stop_pid

VERSION = "v2.5.0"
MODULE = "github.com/Shopify/toxiproxy/v2/cmd/server"
BINARY = "toxiproxy-server"
INSTALL_HINT = (
    "Run scripts/bootstrap (it needs Go: https://go.dev/dl/), or build it yourself: "
    f"`GOBIN=$HOME/.cache/outboxkit/bin go install {MODULE}@{VERSION} && "
    f"mv $HOME/.cache/outboxkit/bin/server $HOME/.cache/outboxkit/bin/{BINARY}`; "
    "or set OUTBOXKIT_TOXIPROXY_BIN to a toxiproxy-server."
)

Stream = Literal["upstream", "downstream"]
"""A toxic's direction: ``upstream`` is client → server, ``downstream`` server → client."""


def via(url: str, address: str) -> str:
    """*url* (one host) with its host and port replaced by *address* (``host:port``)."""
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{userinfo}{at}{address}", parts.path, parts.query,
                       parts.fragment))


def bin_dir() -> Path:
    """Where scripts/bootstrap puts the binary: a folder of the project's own, not ~/go/bin
    (the Go module's binary is called just ``server``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "outboxkit" / "bin"


def executable() -> Path:
    """The toxiproxy-server to run: OUTBOXKIT_TOXIPROXY_BIN, bootstrap's, or one on PATH."""
    override = os.environ.get("OUTBOXKIT_TOXIPROXY_BIN")
    if override:
        if not Path(override).is_file():
            raise MissingToolError(f"{BINARY} at OUTBOXKIT_TOXIPROXY_BIN={override}",
                                   INSTALL_HINT)
        return Path(override)
    built = bin_dir() / BINARY
    if built.is_file():
        return built
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    raise MissingToolError(f"{BINARY} (Toxiproxy {VERSION})", INSTALL_HINT)


class ToxiproxyError(ServiceError):
    """The Toxiproxy API refused a request or did not answer."""


@dataclass(frozen=True)
class Proxy:
    name: str
    listen: str  # host:port the proxy listens on (the port chosen by the server for ":0")
    upstream: str
    enabled: bool = True

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def address(self) -> str:
        """``127.0.0.1:port``: what a client connects to instead of the upstream."""
        return f"127.0.0.1:{self.port}"


def _proxy(data: Any) -> Proxy:
    return Proxy(str(data["name"]), str(data["listen"]), str(data["upstream"]),
                 bool(data.get("enabled", True)))


class Client:
    """The HTTP API of one Toxiproxy server (``http://127.0.0.1:8474``)."""

    def __init__(self, api: str, *, timeout_s: float = 10.0) -> None:
        self.api = api.rstrip("/")
        self.timeout_s = timeout_s

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        if not self.api.startswith("http://"):
            raise ToxiproxyError(f"the Toxiproxy API must be an http:// URL, not {self.api!r}")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(  # noqa: S310 - http:// only, checked above
            f"{self.api}{path}", data=data, method=method,
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace").strip()
            raise ToxiproxyError(f"Toxiproxy {method} {path}: HTTP {exc.code}: {detail}") from exc
        except OSError as exc:
            raise ToxiproxyError(f"Toxiproxy at {self.api} did not answer {method} {path}: "
                                 f"{exc}") from exc

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        raw = self._send(method, path, body)
        return json.loads(raw) if raw.strip() else None

    def version(self) -> str:
        """The server's version ("git" when built by ``go install``, without release flags)."""
        raw = self._send("GET", "/version").decode().strip()
        # 2.5 answers the bare version; later ones a JSON object.
        return str(json.loads(raw)["version"]) if raw.startswith("{") else raw

    # --- proxies -------------------------------------------------------------------------
    def create(self, name: str, upstream: str, listen: str = "127.0.0.1:0") -> Proxy:
        """A proxy from *listen* (port 0: the server picks a free one) to *upstream*."""
        return _proxy(self._call("POST", "/proxies",
                                 {"name": name, "listen": listen, "upstream": upstream,
                                  "enabled": True}))

    def front(self, name: str, url: str) -> str:
        """A proxy *name* in front of the server of *url* (one host, a libpq or SQLAlchemy
        URL); *url* pointed at the proxy instead."""
        parts = urlsplit(url)
        return via(url, self.create(name, f"{parts.hostname}:{parts.port}").address)

    def get(self, name: str) -> Proxy:
        return _proxy(self._call("GET", f"/proxies/{name}"))

    def proxies(self) -> dict[str, Proxy]:
        data = self._call("GET", "/proxies")
        return {str(name): _proxy(p) for name, p in dict(data).items()}

    def delete(self, name: str) -> None:
        self._call("DELETE", f"/proxies/{name}")

    def enable(self, name: str) -> Proxy:
        return _proxy(self._call("POST", f"/proxies/{name}", {"enabled": True}))

    def disable(self, name: str) -> Proxy:
        """Cut the proxy: its open connections are closed, new ones refused (a clean
        partition: both sides see the connection end)."""
        return _proxy(self._call("POST", f"/proxies/{name}", {"enabled": False}))

    def reset(self) -> None:
        """Every proxy enabled again and every toxic removed."""
        self._call("POST", "/reset")

    # --- toxics --------------------------------------------------------------------------
    def add_toxic(self, proxy: str, kind: str, attributes: dict[str, int], *,
                  stream: Stream = "downstream", name: str | None = None,
                  toxicity: float = 1.0) -> str:
        """Add a toxic of type *kind* to *proxy*; returns its name (by default
        ``<kind>_<stream>``, Toxiproxy's own convention)."""
        name = name or f"{kind}_{stream}"
        self._call("POST", f"/proxies/{proxy}/toxics",
                   {"name": name, "type": kind, "stream": stream, "toxicity": toxicity,
                    "attributes": attributes})
        return name

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")

    def toxics(self, proxy: str) -> list[dict[str, Any]]:
        return list(self._call("GET", f"/proxies/{proxy}/toxics"))

    def latency(self, proxy: str, ms: int, jitter_ms: int = 0, *,
                stream: Stream = "downstream") -> str:
        """Every chunk of data delayed by *ms* ± *jitter_ms*."""
        return self.add_toxic(proxy, "latency", {"latency": ms, "jitter": jitter_ms},
                              stream=stream)

    def bandwidth(self, proxy: str, kb_per_s: int, *, stream: Stream = "downstream") -> str:
        """At most *kb_per_s* KB a second."""
        return self.add_toxic(proxy, "bandwidth", {"rate": kb_per_s}, stream=stream)

    def timeout(self, proxy: str, ms: int, *, stream: Stream = "downstream") -> str:
        """Stop forwarding; close the connection after *ms*, or never with 0 (half-open:
        the client's socket stays open and silent until its own timeouts notice)."""
        return self.add_toxic(proxy, "timeout", {"timeout": ms}, stream=stream)

    def reset_peer(self, proxy: str, ms: int = 0, *, stream: Stream = "downstream") -> str:
        """Reset the connection (TCP RST) after *ms*."""
        return self.add_toxic(proxy, "reset_peer", {"timeout": ms}, stream=stream)

    def limit_data(self, proxy: str, nbytes: int, *, stream: Stream = "downstream") -> str:
        """Close each connection once *nbytes* went through it."""
        return self.add_toxic(proxy, "limit_data", {"bytes": nbytes}, stream=stream)


class Server:
    """A toxiproxy-server of our own on a free loopback port, stopped by its pid."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.popen: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> Client:
        if self.popen is None:
            raise ToxiproxyError("the Toxiproxy server is not started: call start() first")
        return Client(self.api)

    def start(self, *, ready_timeout_s: float = 15.0) -> Client:
        binary = executable()
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / "toxiproxy.log"
        for _ in range(3):  # a port taken between free_port() and the bind: another one
            self.port = free_port()
            with log_path.open("ab") as log:
                self.popen = subprocess.Popen(
                    [str(binary), "-host", "127.0.0.1", "-port", str(self.port)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            (self.workdir / "toxiproxy.pid").write_text(f"{self.popen.pid}\n")
            client = Client(self.api, timeout_s=2)
            deadline = time.monotonic() + ready_timeout_s
            while time.monotonic() < deadline and self.popen.poll() is None:
                try:
                    client.version()
                    return Client(self.api)
                except ToxiproxyError:
                    time.sleep(0.05)
            self.stop()
        tail = log_path.read_text(errors="replace")[-1500:]
        raise ServiceError(f"{binary} did not answer on 127.0.0.1:{self.port}:\n{tail}")

    def stop(self) -> None:
        if self.popen is None:
            return
        popen, self.popen = self.popen, None
        if pid_alive(popen.pid):
            stop_pid(popen.pid, grace_s=5)
        popen.wait(timeout=10)
        (self.workdir / "toxiproxy.pid").unlink(missing_ok=True)

    def __enter__(self) -> Client:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
