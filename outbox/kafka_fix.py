"""A fix for kafka-python 3.0's socket reader: the bytes that arrive together with a close.

kafka-python 3.0 (``kafka.net.transport``) reads a socket until it would block. When that
read ends with the peer's close, it drops the bytes it read before the close and reports
only "socket disconnected". A broker that refuses a SASL password sends its error response
and closes the connection right after it, so the refusal ("Authentication failed: Invalid
username or password") was mostly lost: an operator with a wrong password saw nothing but
disconnects. A response to any request that arrives just before a close is lost the same
way (the request is then retried).

:func:`install` wraps the reader of kafka-python's TCP and TLS transports, once per
process, for every kafka-python client in it: the bytes read are handed over first, and the
close is seen on the next read (a socket at end-of-file stays readable). Only that case
changes; every other error is returned as kafka-python returns it. outboxkit's clients get
it through :meth:`outbox.settings.ConnectionSettings.kafka_client_config`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

_MARK = "_outboxkit_keeps_data_before_close"


def install() -> None:
    """Wrap kafka-python 3.0's socket readers (idempotent; nothing when it has none)."""
    try:
        transport = importlib.import_module("kafka.net.transport")
        errors = importlib.import_module("kafka.errors")
    except ImportError:  # another kafka-python layout: nothing of this to fix
        return
    for name in ("KafkaTCPTransport", "KafkaSSLTransport"):
        cls: Any = getattr(transport, name, None)
        original = None if cls is None else cls.__dict__.get("_sock_recv")
        if original is None or getattr(original, _MARK, False):
            continue
        cls._sock_recv = _keeping_data(original, errors.KafkaConnectionError)


def _keeping_data(
    original: Callable[[Any], tuple[bytes, BaseException | None]], disconnected: type[BaseException]
) -> Callable[[Any], tuple[bytes, BaseException | None]]:
    @functools.wraps(original)
    def _sock_recv(self: Any) -> tuple[bytes, BaseException | None]:
        data, err = original(self)
        closed = isinstance(err, disconnected) and err.args == ("socket disconnected",)
        if data and closed:
            return data, None  # the next read finds the close again
        return data, err

    setattr(_sock_recv, _MARK, True)
    return _sock_recv
