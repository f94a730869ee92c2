"""kafka-python's reader hands over the bytes a broker sent right before closing."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kafka.consumer.fetcher import Fetcher
from kafka.coordinator.consumer import ConsumerCoordinator
from kafka.errors import KafkaConnectionError, KafkaTimeoutError
from kafka.net.inet import KafkaNetSocket
from kafka.net.transport import KafkaSSLTransport, KafkaTCPTransport

from outbox import kafka_fix
from outbox.settings import ConnectionSettings


@pytest.fixture
def closed_after_reply() -> Iterator[socket.socket]:
    """Our end of a connection whose peer wrote a reply and closed (both already arrived)."""
    ours, peer = socket.socketpair()
    peer.sendall(b"the broker's error response")
    peer.close()
    ours.setblocking(False)
    try:
        yield ours
    finally:
        ours.close()


def test_the_reply_comes_first_and_the_close_on_the_next_read(
    closed_after_reply: socket.socket,
) -> None:
    kafka_fix.install()
    transport = KafkaTCPTransport(None, closed_after_reply)
    assert transport._sock_recv() == (b"the broker's error response", None)
    data, err = transport._sock_recv()
    assert data == b""
    assert isinstance(err, KafkaConnectionError)


def test_without_the_fix_kafka_python_drops_the_reply(closed_after_reply: socket.socket) -> None:
    # What the fix is for; if a kafka-python release stops doing this, the fix can go.
    kafka_fix.install()
    original = KafkaTCPTransport._sock_recv.__wrapped__  # type: ignore[attr-defined]
    data, err = original(KafkaTCPTransport(None, closed_after_reply))
    assert data == b"the broker's error response"
    assert isinstance(err, KafkaConnectionError)


def test_other_errors_pass_unchanged(closed_after_reply: socket.socket) -> None:
    kafka_fix.install()
    transport = KafkaTCPTransport(None, closed_after_reply)
    transport._sock = None  # recv on None: kafka-python's own "error receiving" path
    data, err = transport._sock_recv()
    assert data == b""
    assert isinstance(err, KafkaConnectionError)
    assert err.args != ("socket disconnected",)


@pytest.mark.parametrize(
    ("cls", "attribute"),
    [
        (KafkaTCPTransport, "_sock_recv"),
        (KafkaSSLTransport, "_sock_recv"),
        (ConsumerCoordinator, "need_rejoin"),
        (KafkaNetSocket, "sock_connect"),
        (Fetcher, "fetched_records"),
    ],
)
def test_installed_once_by_every_client_config(cls: type, attribute: str) -> None:
    ConnectionSettings(kafka_bootstrap="127.0.0.1:9092").kafka_client_config()
    ConnectionSettings(kafka_bootstrap="127.0.0.1:9092").kafka_client_config()
    wrapped = cls.__dict__[attribute]
    assert getattr(wrapped, "_outboxkit_fixed", False), cls
    assert not hasattr(wrapped.__wrapped__, "__wrapped__"), "wrapped twice"


class _Pending:
    """What kafka-python's event loop awaits while a connect is in progress."""

    def __await__(self):  # type: ignore[no-untyped-def]
        yield "wait-write"


class _Net:
    def wait_write(self, sock: object, timeout_at: object = None) -> _Pending:
        return _Pending()


def _factory(connect_ex_result: int) -> KafkaNetSocket:
    kafka_fix.install()
    factory = KafkaNetSocket()
    factory.connect_ex = lambda sock, addr: connect_ex_result  # type: ignore[method-assign]
    return factory


def _connect_in_progress(
    sock_connect: Callable[..., Any] | None = None,
) -> tuple[Any, socket.socket]:
    """A connect waiting for the socket to be writable (through the fix unless given)."""
    factory = _factory(errno.EINPROGRESS)
    sock = socket.socket()
    coro = (sock_connect or KafkaNetSocket.sock_connect)(factory, _Net(), sock, ("127.0.0.1", 9))
    assert coro.send(None) == "wait-write"
    return coro, sock


def test_a_cancelled_connect_closes_its_socket() -> None:
    coro, sock = _connect_in_progress()
    coro.close()  # what kafka-python's Task.cancel does
    assert sock.fileno() == -1


def test_a_connect_that_times_out_closes_its_socket() -> None:
    coro, sock = _connect_in_progress()
    with pytest.raises(KafkaTimeoutError):
        coro.throw(KafkaTimeoutError("Connection timed out"))
    assert sock.fileno() == -1


def test_a_connect_that_succeeds_keeps_its_socket() -> None:
    with socket.socket() as sock:
        coro = _factory(0).sock_connect(_Net(), sock, ("127.0.0.1", 9))
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        assert done.value.value is sock
        assert sock.fileno() != -1


def test_without_the_fix_a_cancelled_connect_leaves_its_socket_open() -> None:
    # What the fix is for; if a kafka-python release stops doing this, the fix can go.
    kafka_fix.install()
    original = KafkaNetSocket.sock_connect.__wrapped__  # type: ignore[attr-defined]
    coro, sock = _connect_in_progress(original)
    with sock:
        coro.close()
        assert sock.fileno() != -1
