"""A local supplier: an HTTP order API with idempotency keys that misbehaves on request.

It plays the outside system of the working example (an agent orders from a supplier) for
tests and the demo. Standard library only; threaded, so a slow answer does not block the
status endpoint.

State is kept **in memory** (a dict under a lock): it lives exactly as long as the process
— or, started in a thread with :func:`start_supplier`, as long as that server object.

Endpoints::

    POST /orders                      header Idempotency-Key, JSON body: 201 new order,
                                      200 the order this key already created (never a
                                      second one), 409 the key was used for another body
    GET  /orders?idempotency_key=K    status query: 200 the order, 404 {"error": "not-found"}
    GET  /orders/all                  every order held, with how many POSTs each key got
    GET  /control                     the current behaviour
    POST /control                     {"orders": {"mode": M, "delay": s, "times": n},
                                       "status": {"mode": M, ...},   (times: then normal)
                                       "items": {"ITEM": {"mode": M, ...}}}  (orders whose
                                       body has that "item"; they win over "orders")
    POST /control/reset               forget every order; behave normally

Order modes: ``normal``; ``slow`` (answer after *delay*); ``apply-then-timeout`` (take the
order, answer only after *delay* — past the client's timeout); ``apply-then-drop`` (take the
order, close the connection without answering); ``drop`` (close without taking it);
``refuse`` (422, nothing taken); ``down`` (503, nothing taken).
Status modes: ``normal``; ``down`` (503); ``timeout`` (answer after *delay*).

Run: ``python examples/supplier.py --port 8080`` (``--port 0`` picks a free port; the first
line printed is ``supplier listening on http://HOST:PORT``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

ORDER_MODES = {"normal", "slow", "apply-then-timeout", "apply-then-drop", "drop", "refuse", "down"}
STATUS_MODES = {"normal", "down", "timeout"}


@dataclass
class Behaviour:
    """How one endpoint behaves; after *times* requests (None: forever) it is normal again."""

    mode: str = "normal"
    delay: float = 0.0
    times: int | None = None

    def take(self) -> tuple[str, float]:
        """The mode for this request (counting it against *times*)."""
        mode, delay = self.mode, self.delay
        if self.times is not None:
            self.times -= 1
            if self.times <= 0:
                self.mode, self.delay, self.times = "normal", 0.0, None
        return mode, delay

    def as_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "delay": self.delay, "times": self.times}


@dataclass
class SupplierState:
    """Orders by idempotency key, POST counts, and the behaviour switches (thread-safe)."""

    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    posts: dict[str, int] = field(default_factory=dict)
    # POSTs that arrived for a key whose order already existed: a client that reconciles
    # properly sends none after a timeout (it asks the status endpoint instead).
    repeat_posts: dict[str, int] = field(default_factory=dict)
    item_behaviours: dict[str, Behaviour] = field(default_factory=dict)
    orders_behaviour: Behaviour = field(default_factory=Behaviour)
    status_behaviour: Behaviour = field(default_factory=Behaviour)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def place(self, key: str, body: Any) -> tuple[int, dict[str, Any]]:
        """Create the order for *key*, or return the one it already created."""
        with self.lock:
            existing = self.orders.get(key)
            if existing is not None:
                if existing["request"] != body:
                    return 409, {"error": "idempotency-key-reused",
                                 "detail": "this key was used for a different request"}
                return 200, existing
            order = {
                "order_id": f"ORD-{len(self.orders) + 1:05d}",
                "idempotency_key": key,
                "request": body,
                "created_at": datetime.now(UTC).isoformat(),
            }
            self.orders[key] = order
            return 201, order

    def count_post(self, key: str) -> None:
        with self.lock:
            self.posts[key] = self.posts.get(key, 0) + 1
            if key in self.orders:
                self.repeat_posts[key] = self.repeat_posts.get(key, 0) + 1

    def behaviour_for(self, body: Any) -> tuple[str, float]:
        """The mode for this order: its item's rule if one is set, else the global one."""
        with self.lock:
            item = body.get("item") if isinstance(body, dict) else None
            rule = self.item_behaviours.get(item) if isinstance(item, str) else None
            return (rule or self.orders_behaviour).take()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "orders": [{**o, "posts": self.posts.get(k, 0)} for k, o in self.orders.items()],
                "posts": dict(self.posts),
                "repeat_posts": dict(self.repeat_posts),
            }

    def control(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            for name, behaviour, modes in (("orders", self.orders_behaviour, ORDER_MODES),
                                           ("status", self.status_behaviour, STATUS_MODES)):
                wanted = body.get(name)
                if wanted is None:
                    continue
                if wanted.get("mode", "normal") not in modes:
                    raise ValueError(f"{name} mode must be one of {sorted(modes)}")
                behaviour.mode = wanted.get("mode", "normal")
                behaviour.delay = float(wanted.get("delay", 0.0))
                behaviour.times = wanted.get("times")
            for item, wanted in (body.get("items") or {}).items():
                if wanted.get("mode", "normal") not in ORDER_MODES:
                    raise ValueError(f"item mode must be one of {sorted(ORDER_MODES)}")
                self.item_behaviours[item] = Behaviour(
                    wanted.get("mode", "normal"), float(wanted.get("delay", 0.0)),
                    wanted.get("times"))
            return self.describe_unlocked()

    def describe_unlocked(self) -> dict[str, Any]:
        return {"orders": self.orders_behaviour.as_json(),
                "status": self.status_behaviour.as_json(),
                "items": {k: b.as_json() for k, b in self.item_behaviours.items()}}

    def reset(self) -> None:
        with self.lock:
            self.orders.clear()
            self.posts.clear()
            self.repeat_posts.clear()
            self.item_behaviours.clear()
            self.orders_behaviour = Behaviour()
            self.status_behaviour = Behaviour()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a sleeping handler never holds up shutdown
    state: SupplierState


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read the supplier's record through /orders/all instead."""

    # --- plumbing ---------------------------------------------------------------------------
    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else None

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (timed out) before we answered: that is the point

    def _drop(self) -> None:
        """Close the connection without a word (the client sees it dropped)."""
        self.close_connection = True

    # --- routes -----------------------------------------------------------------------------
    def do_GET(self) -> None:
        url = urlsplit(self.path)
        state = self.server.state
        if url.path == "/orders/all":
            self._send(200, state.snapshot())
        elif url.path == "/control":
            with state.lock:
                self._send(200, state.describe_unlocked())
        elif url.path == "/orders":
            self._status(parse_qs(url.query).get("idempotency_key", [""])[0])
        else:
            self._send(404, {"error": "no-such-endpoint"})

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        state = self.server.state
        try:
            body = self._body()
        except ValueError:
            self._send(400, {"error": "body is not JSON"})
            return
        if url.path == "/orders":
            self._order(body)
        elif url.path == "/control":
            try:
                self._send(200, state.control(body or {}))
            except (ValueError, AttributeError) as exc:
                self._send(400, {"error": str(exc)})
        elif url.path == "/control/reset":
            state.reset()
            self._send(200, {"reset": True})
        else:
            self._send(404, {"error": "no-such-endpoint"})

    def _order(self, body: Any) -> None:
        state = self.server.state
        key = self.headers.get("Idempotency-Key")
        if not key:
            self._send(400, {"error": "the Idempotency-Key header is required"})
            return
        state.count_post(key)
        mode, delay = state.behaviour_for(body)
        if mode == "down":
            self._send(503, {"error": "unavailable"})
        elif mode == "refuse":
            self._send(422, {"error": "refused", "detail": "item not orderable"})
        elif mode == "drop":
            self._drop()
        else:
            if mode == "slow":
                time.sleep(delay)
            status, order = state.place(key, body)
            if mode == "apply-then-drop":
                self._drop()
                return
            if mode == "apply-then-timeout":
                time.sleep(delay)
            self._send(status, order)

    def _status(self, key: str) -> None:
        state = self.server.state
        with state.lock:
            mode, delay = state.status_behaviour.take()
            order = state.orders.get(key)
        if mode == "down":
            self._send(503, {"error": "unavailable"})
            return
        if mode == "timeout":
            time.sleep(delay)
        if order is None:
            self._send(404, {"error": "not-found", "idempotency_key": key})
        else:
            self._send(200, order)


class Supplier:
    """A supplier server; ``start()`` serves it from a daemon thread, ``stop()`` ends it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = SupplierState()
        self.server = _Server((host, port), _Handler)
        self.server.state = self.state
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Supplier:
        self._thread = threading.Thread(target=self.server.serve_forever, name="supplier",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Supplier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_supplier(host: str = "127.0.0.1", port: int = 0) -> Supplier:
    """A supplier serving from a thread of this process (``port=0``: a free port)."""
    return Supplier(host, port).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A local supplier HTTP server (in memory).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    args = parser.parse_args(argv)
    supplier = Supplier(args.host, args.port)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=supplier.server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stdout.write(f"supplier listening on {supplier.url}\n")
    sys.stdout.flush()
    supplier.server.serve_forever()
    supplier.server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
