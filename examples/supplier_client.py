"""The supplier as an outboxkit :class:`~dedup.ledger.System`: how an application adapts
an outside HTTP API to the ledger's typed answers.

The mapping is the part that needs judgement, so it is spelled out here:

* 2xx → ``Applied`` (the order id is the evidence's reference);
* 4xx other than 404/408/429 → ``Refused``: a definite no, nothing was applied;
* 5xx, 408, 429, a timeout or a dropped connection → ``Unclear``: it may have been applied.

The status query: 200 → ``Found``; 404 with ``{"error": "not-found"}`` → ``NotFound`` (a
bare 404 from some proxy would prove nothing, so it is ``Unclear``); anything else → ``Unclear``.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from dedup.ledger import (
    Applied,
    CallOutcome,
    Evidence,
    Found,
    NotFound,
    Operation,
    Refused,
    StatusOutcome,
    System,
    Unclear,
)

_UNCLEAR_4XX = {404, 408, 429}


class SupplierClient:
    """Calls the supplier at *base_url*; every request gives up after *timeout* seconds."""

    def __init__(self, base_url: str, *, timeout: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _request(self, method: str, path: str, body: Any = None,
                 headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(  # noqa: S310 - our own http:// base URL
            self.base_url + path, data=data, method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            exc.close()
            try:
                return exc.code, json.loads(raw or b"null")
            except ValueError:
                return exc.code, {"raw": raw.decode("utf-8", "replace")}

    def place_order(self, operation: Operation) -> CallOutcome:
        """POST the operation's request with its idempotency key."""
        try:
            status, body = self._request(
                "POST", "/orders", operation.request,
                {"Idempotency-Key": operation.idempotency_key},
            )
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException,
                ConnectionError) as exc:
            return Unclear(f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            return Applied(Evidence.of_response(body, reference=body.get("order_id"),
                                                http_status=status))
        if 400 <= status < 500 and status not in _UNCLEAR_4XX:
            return Refused(Evidence.of_response(body, http_status=status,
                                                error=(body or {}).get("error")))
        return Unclear(f"HTTP {status}: {body}")

    def order_status(self, operation: Operation) -> StatusOutcome:
        """Look the order up by the operation's idempotency key."""
        query = urllib.parse.urlencode({"idempotency_key": operation.idempotency_key})
        try:
            status, body = self._request("GET", f"/orders?{query}")
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException,
                ConnectionError) as exc:
            return Unclear(f"status query failed: {type(exc).__name__}: {exc}")
        if status == 200:
            return Found(Evidence.of_response(body, reference=body.get("order_id"),
                                              http_status=status, via="status-query"))
        if status == 404 and isinstance(body, dict) and body.get("error") == "not-found":
            return NotFound({"http_status": 404})
        return Unclear(f"status query answered HTTP {status}: {body}")

    def system(self, name: str = "supplier") -> System:
        """This client as the ledger's :class:`System`."""
        return System(name=name, call=self.place_order, status_query=self.order_status)

    # --- for tests and the demo -------------------------------------------------------------
    def all_orders(self) -> list[dict[str, Any]]:
        """The supplier's own record of every order (``GET /orders/all``)."""
        _, body = self._request("GET", "/orders/all")
        return list(body["orders"])

    def record(self) -> dict[str, Any]:
        """Orders, POSTs per key and repeated POSTs per key, in one snapshot."""
        _, body = self._request("GET", "/orders/all")
        return dict(body)

    def posts(self) -> dict[str, int]:
        """How many POST /orders each idempotency key received."""
        _, body = self._request("GET", "/orders/all")
        return dict(body["posts"])

    def control(self, **behaviour: dict[str, Any]) -> dict[str, Any]:
        """Switch behaviours: ``control(orders={"mode": "refuse", "times": 1})``."""
        _, body = self._request("POST", "/control", behaviour)
        return dict(body)
