"""outboxkit's fixes for kafka-python bugs, and the loud failure when one cannot be applied."""

from __future__ import annotations

import errno
import socket
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kafka
import kafka.consumer.fetcher
import kafka.coordinator.consumer
import pytest
from kafka.consumer.fetcher import Fetcher
from kafka.coordinator.consumer import ConsumerCoordinator
from kafka.errors import KafkaConnectionError, KafkaTimeoutError
from kafka.net.inet import KafkaNetSocket
from kafka.net.manager import KafkaConnectionManager
from kafka.net.transport import KafkaSSLTransport, KafkaTCPTransport

from outbox.errors import ConfigurationError, KafkaClientIncompatible
from outbox.kafka import kafka_python_fixes as kafka_fix
from outbox.kafka.api import Connection
from outbox.kafka.kafka_python import client_config


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
    original = KafkaTCPTransport._sock_recv.__wrapped__
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


_PATCHED = [
    (KafkaTCPTransport, "_sock_recv"),
    (KafkaSSLTransport, "_sock_recv"),
    (ConsumerCoordinator, "need_rejoin"),
    (KafkaNetSocket, "sock_connect"),
    (Fetcher, "fetched_records"),
    (KafkaConnectionManager, "least_loaded_node"),
]


@pytest.mark.parametrize(("cls", "attribute"), _PATCHED)
def test_installed_once(cls: type, attribute: str) -> None:
    kafka_fix.install()
    kafka_fix.install()
    wrapped = cls.__dict__[attribute]
    assert getattr(wrapped, "_outboxkit_fixed", False), cls
    assert not hasattr(wrapped.__wrapped__, "__wrapped__"), "wrapped twice"


@pytest.mark.parametrize(("cls", "attribute"), _PATCHED)
def test_installed_by_every_kafka_python_client_config(cls: type, attribute: str) -> None:
    client_config(Connection("127.0.0.1:9092"))
    assert getattr(cls.__dict__[attribute], "_outboxkit_fixed", False), cls


def test_a_client_config_refuses_an_incompatible_kafka_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(KafkaNetSocket, "sock_connect")
    with pytest.raises(KafkaClientIncompatible, match="sock_connect"):
        client_config(Connection("127.0.0.1:9092"))


# kafka-python releases that move or change what a fix patches. The classes are patched
# already when these run (install() is once per process), so each case also shows that the
# check looks through an installed fix to kafka-python's original.


def _incompatible(*parts: str) -> KafkaClientIncompatible:
    with pytest.raises(KafkaClientIncompatible) as raised:
        kafka_fix.install()
    message = str(raised.value)
    for part in parts:
        assert part in message, message
    return raised.value


def test_a_module_that_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kafka.net.inet", None)  # import_module raises
    _incompatible("module kafka.net.inet", "does not import",
                  "a socket left open by a connection attempt")


def test_a_missing_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(kafka.consumer.fetcher, "Fetcher")
    _incompatible("class kafka.consumer.fetcher.Fetcher", "is missing",
                  "a paused partition whose fetched data")


def test_a_missing_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(KafkaNetSocket, "sock_connect")
    _incompatible("kafka.net.inet.KafkaNetSocket.sock_connect", "is missing")


def test_an_attribute_that_is_not_a_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Fetcher, "fetched_records", property(lambda self: []))
    _incompatible("Fetcher.fetched_records", "is not a plain function", "property")


def test_a_changed_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    async def sock_connect(self: Any, net: Any, sock: Any, address: Any) -> Any:
        return sock

    monkeypatch.setattr(KafkaNetSocket, "sock_connect", sock_connect)
    _incompatible("KafkaNetSocket.sock_connect", "has changed its parameters",
                  "(self, net, sock, address)", "(self, net, sock, sockaddr, timeout_at)")


def test_a_changed_signature_under_an_installed_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def fetched_records(self: Any, max_records: Any = None) -> Any:
        return {}, False

    wrapped = kafka_fix._resuming_kept_data(fetched_records)
    wrapped._outboxkit_fixed = True  # type: ignore[attr-defined]
    monkeypatch.setattr(Fetcher, "fetched_records", wrapped)
    _incompatible("Fetcher.fetched_records", "(self, max_records)")


def test_a_connect_that_is_no_longer_a_coroutine(monkeypatch: pytest.MonkeyPatch) -> None:
    def sock_connect(self: Any, net: Any, sock: Any, sockaddr: Any, timeout_at: Any = None) -> Any:
        return sock

    monkeypatch.setattr(KafkaNetSocket, "sock_connect", sock_connect)
    _incompatible("KafkaNetSocket.sock_connect", "is no longer a coroutine function")


def test_a_reader_that_reports_a_close_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    def _sock_recv(self: Any) -> tuple[bytes, BaseException | None]:
        data = self._sock.recv(4096)
        return data, None if data else KafkaConnectionError("peer closed")

    monkeypatch.setattr(KafkaSSLTransport, "_sock_recv", _sock_recv)
    _incompatible("KafkaSSLTransport._sock_recv", "no longer uses 'socket disconnected'")


def test_a_coordinator_without_the_join_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    class ConsumerCoordinator:  # a release that renamed ``rejoining``
        def __init__(self) -> None:
            self.join_prepared = False

        def need_rejoin(self) -> bool:
            return self.join_prepared

    monkeypatch.setattr(kafka.coordinator.consumer, "ConsumerCoordinator", ConsumerCoordinator)
    _incompatible("ConsumerCoordinator.need_rejoin", "no longer uses 'rejoining'")


def test_the_error_says_what_is_installed_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kafka, "__version__", "3.1.0")
    monkeypatch.delattr(KafkaNetSocket, "sock_connect")
    monkeypatch.delattr(kafka.consumer.fetcher, "Fetcher")
    error = _incompatible(
        "kafka-python 3.1.0 is installed", "Nothing was patched",
        "outboxkit supports kafka-python>=3.0.12,<3.1", "OUTBOXKIT_KAFKA_CLIENT=confluent")
    assert isinstance(error, ConfigurationError)
    assert error.version == "3.1.0"
    assert len(error.problems) == 2, error.problems  # every problem, not only the first


def test_nothing_is_patched_when_one_part_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    kafka_fix.install()
    for cls, attribute in _PATCHED:  # kafka-python's originals, as before any install
        monkeypatch.setattr(cls, attribute, cls.__dict__[attribute].__wrapped__)
    monkeypatch.delattr(kafka.consumer.fetcher, "Fetcher")
    _incompatible("class kafka.consumer.fetcher.Fetcher")
    for cls, attribute in _PATCHED:
        assert not hasattr(cls.__dict__[attribute], "_outboxkit_fixed"), (cls, attribute)


def test_the_supported_range_is_the_dependency() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert kafka_fix.SUPPORTED in pyproject["project"]["dependencies"]


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
    factory.connect_ex = lambda sock, addr: connect_ex_result
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
    original = KafkaNetSocket.sock_connect.__wrapped__
    coro, sock = _connect_in_progress(original)
    with sock:
        coro.close()
        assert sock.fileno() != -1


# Choosing the node for a metadata or coordinator lookup: kafka-python's manager with only
# what least_loaded_node reads (its brokers, its connections, their backoff).


class _Conn:
    def __init__(self, state: str = "connected", in_flight: int = 0) -> None:
        self.connected = state in ("connected", "paused")
        self.paused = state == "paused"
        self.initializing = state == "initializing"
        self.in_flight_requests = [object()] * in_flight


class _Broker:
    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _Manager:
    def __init__(self, conns: dict[int, _Conn | None], backing_off: frozenset[int] = frozenset(),
                 ) -> None:
        self._conns = {n: c for n, c in conns.items() if c is not None}
        self._nodes = list(conns)
        self.backing_off = backing_off
        self.cluster = self

    def brokers(self) -> list[_Broker]:
        return [_Broker(n) for n in self._nodes]

    def connection_delay(self, node_id: int) -> float:
        return 1.0 if node_id in self.backing_off else 0.0


def _chosen(manager: _Manager, choose: Callable[[Any], Any] | None = None) -> set[Any]:
    kafka_fix.install()
    choose = choose or KafkaConnectionManager.least_loaded_node
    return {choose(manager) for _ in range(200)}  # the order of the nodes is random


def test_a_connected_node_with_a_fetch_in_flight_before_one_to_connect_to() -> None:
    # A consumer's leaders (1, 2) each have a fetch in flight; 3 is the node that hung: its
    # connection was closed when its request timed out, and nothing backs it off.
    manager = _Manager({1: _Conn(in_flight=1), 2: _Conn(in_flight=1), 3: None})
    assert _chosen(manager) == {1, 2}


def test_without_the_fix_kafka_python_asks_the_node_it_is_not_connected_to() -> None:
    # What the fix is for; if a kafka-python release stops choosing so, the fix can go.
    kafka_fix.install()
    original = KafkaConnectionManager.least_loaded_node.__wrapped__
    manager = _Manager({1: _Conn(in_flight=1), 2: _Conn(in_flight=1), 3: None})
    assert _chosen(manager, original) == {3}


def test_an_idle_connection_first_then_the_fewest_requests_in_flight() -> None:
    assert _chosen(_Manager({1: _Conn(in_flight=2), 2: _Conn(), 3: None})) == {2}
    assert _chosen(_Manager({1: _Conn(in_flight=3), 2: _Conn(in_flight=1), 3: None})) == {2}
    assert _chosen(_Manager({1: _Conn(), 2: _Conn(), 3: _Conn(in_flight=1)})) == {1, 2}


def test_without_a_connected_node_kafka_pythons_own_choice() -> None:
    # Not connected anywhere usable: any node not backing off, a connection being made too.
    assert _chosen(_Manager({1: _Conn("paused", 5), 2: _Conn("initializing"), 3: None})) == {2, 3}
    assert _chosen(_Manager({1: _Conn("paused", 5), 2: None, 3: None}, frozenset({2}))) == {3}
    assert _chosen(_Manager({1: _Conn("paused", 5), 2: None}, frozenset({2}))) == {None}


def test_a_manager_that_chooses_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    def least_loaded_node(self: Any) -> Any:  # a release that tracks load differently
        return min(self.load, key=self.load.get, default=None)

    monkeypatch.setattr(KafkaConnectionManager, "least_loaded_node", least_loaded_node)
    _incompatible("KafkaConnectionManager.least_loaded_node", "no longer uses",
                  "a broker that hangs")
