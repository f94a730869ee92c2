"""``/metrics``, ``/healthz`` and ``/readyz`` on a small threaded HTTP server."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class HealthServer:
    """Serves the registry and two probes; the probes are callables read per request."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        healthy: Callable[[], bool],
        ready: Callable[[], bool],
        *,
        name: str = "outboxkit-http",
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    outer._reply(self, 200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif self.path == "/healthz":
                    ok = healthy()
                    outer._reply(self, 200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")
                elif self.path == "/readyz":
                    ok = ready()
                    outer._reply(self, 200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                else:
                    outer._reply(self, 404, b"not found\n")

            def log_message(self, format: str, *args: object) -> None:
                return  # probes every few seconds would flood the log

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name=name, daemon=True
        )

    @staticmethod
    def _reply(
        handler: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
