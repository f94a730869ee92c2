"""Four fixes for kafka-python 3.0, installed once per process for every client in it.

**The bytes that arrive together with a close.** kafka-python 3.0 (``kafka.net.transport``)
reads a socket until it would block. When that read ends with the peer's close, it drops
the bytes it read before the close and reports only "socket disconnected". A broker that
refuses a SASL password sends its error response and closes the connection right after it,
so the refusal ("Authentication failed: Invalid username or password") was mostly lost: an
operator with a wrong password saw nothing but disconnects. A response to any request that
arrives just before a close is lost the same way (the request is then retried).

:func:`install` wraps the reader of kafka-python's TCP and TLS transports: the bytes read
are handed over first, and the close is seen on the next read (a socket at end-of-file stays
readable). Only that case changes; every other error is returned as kafka-python returns it.

**A join in flight that nobody finishes.** A consumer group member runs a join as a task
(JoinGroup, then SyncGroup) and ``poll()`` awaits it for as long as ``need_rejoin()`` is
true. When the rejoin was asked for only because the leader's metadata changed since its
last assignment, ``need_rejoin()`` turns false as soon as the leader computes the new
assignment, inside the task, before SyncGroup answers. ``poll()`` then stops awaiting the
task: the assignment it brings is never applied, the heartbeat stays disabled, the broker
drops the member after ``session_timeout_ms`` and the process polls nothing, forever, while
looking alive. (The Java client checks "rejoin needed *or pending*" for this reason.)
:func:`install` makes ``need_rejoin()`` true while a join kafka-python started is not
complete. Two consumers starting together hit it once in 10 to 40 starts here.

**A socket left open by a connection attempt that did not finish.** When a connect times
out, fails or is cancelled (a client closed while connecting), kafka-python drops the socket
without closing it; Python closes it later, when the garbage collector finds it, with a
``ResourceWarning`` (an error under ``-W error``, as in outboxkit's tests). :func:`install`
closes it at once.

**A paused partition whose fetched data is never handed back.** A consumer keeps what it
fetched for a partition that is paused meanwhile, and gives it back when the partition is
resumed (KAFKA-7548), but only when no other partition's records are "next in line"; a
partition's records that were all taken stay next in line (empty, not ``None``), so the kept
data is never given back, and the partition is never fetched again while it is kept: the
partition stops for good after a ``pause()`` (outboxkit pauses a partition whose message
waits for a retry). :func:`install` clears the emptied records first, as if taken.

outboxkit's clients get all four through
:meth:`outbox.settings.ConnectionSettings.kafka_client_config`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

_MARK = "_outboxkit_fixed"


def install() -> None:
    """Apply the fixes (idempotent; nothing where kafka-python has no such parts)."""
    _wrap("kafka.net.transport", ("KafkaTCPTransport", "KafkaSSLTransport"), "_sock_recv",
          _keeping_data)
    _wrap("kafka.coordinator.consumer", ("ConsumerCoordinator",), "need_rejoin",
          _pending_join_counts)
    _wrap("kafka.net.inet", ("KafkaNetSocket",), "sock_connect", _closing_on_failure)
    _wrap("kafka.consumer.fetcher", ("Fetcher",), "fetched_records", _resuming_kept_data)


def _wrap(
    module: str, classes: tuple[str, ...], attribute: str, make: Callable[[Any], Any]
) -> None:
    """Replace ``attribute`` of each class by ``make(original)``, once."""
    try:
        found = importlib.import_module(module)
    except ImportError:  # another kafka-python layout: nothing of this to fix
        return
    for name in classes:
        cls: Any = getattr(found, name, None)
        original = None if cls is None else cls.__dict__.get(attribute)
        if original is None or getattr(original, _MARK, False):
            continue
        wrapped = make(original)
        setattr(wrapped, _MARK, True)
        setattr(cls, attribute, wrapped)


def _keeping_data(
    original: Callable[[Any], tuple[bytes, BaseException | None]],
) -> Callable[[Any], tuple[bytes, BaseException | None]]:
    disconnected = importlib.import_module("kafka.errors").KafkaConnectionError

    @functools.wraps(original)
    def _sock_recv(self: Any) -> tuple[bytes, BaseException | None]:
        data, err = original(self)
        closed = isinstance(err, disconnected) and err.args == ("socket disconnected",)
        if data and closed:
            return data, None  # the next read finds the close again
        return data, err

    return _sock_recv


def _pending_join_counts(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    @functools.wraps(original)
    def need_rejoin(self: Any) -> bool:
        # ``rejoining`` is set when a join is prepared (listeners called, task started) and
        # cleared only once its assignment is applied.
        if getattr(self, "rejoining", False):
            return True
        return original(self)

    return need_rejoin


def _closing_on_failure(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def sock_connect(self: Any, net: Any, sock: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, net, sock, *args, **kwargs)
        except BaseException:  # cancelled (GeneratorExit) included
            sock.close()
            raise

    return sock_connect


def _resuming_kept_data(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fetched_records(self: Any, *args: Any, **kwargs: Any) -> Any:
        current = getattr(self, "_next_partition_records", None)
        if current is not None and not current:  # all taken: nothing is next in line
            self._next_partition_records = None
        return original(self, *args, **kwargs)

    return fetched_records
