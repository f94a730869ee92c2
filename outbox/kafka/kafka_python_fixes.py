"""Five fixes for kafka-python 3.0, installed once per process for every client in it.

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
drops the member after ``session_timeout_ms`` and the process polls nothing (a first join)
or partitions that are no longer its own (a rejoin), forever, while looking alive. (The
Java client checks "rejoin needed *or pending*" for this reason.) :func:`install` makes
``need_rejoin()`` true while a join kafka-python started is not complete. Two consumers
starting together hit it once in 10 to 40 starts in outboxkit's tests, and 6 times in 21
starts in the reproduction of docs/operations.md.

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

**A broker that hangs is asked again at once.** Metadata and coordinator lookups go to the
"least loaded" node. kafka-python 3.0 prefers a node it has no connection to over a connected
node with a request in flight, and a consumer always has a fetch in flight to the leaders it
reads from. When a broker hangs (alive for the kernel, which still accepts connections, but
silent), the request to it times out, its connection is closed, and the next lookup goes to
it again: a new connection, another request timeout, while the other brokers already know
the new leaders. In the cluster fault harness, kafka-python consumers waited for a broker
stopped with SIGSTOP until it woke (20 s) in 4 of 7 rounds. :func:`install` chooses a
connected node first, fewest requests in flight first, as the Java client does; kafka-python
chooses as before when none is connected (the Java client's next preference, a connection
being made, is often the node that hangs, being connected again after its timeout).

outboxkit's kafka-python clients get all five: :func:`install` is called where outboxkit
configures one. Each fix relies on a kafka-python internal, so :func:`install` first checks
all of them (module, class, a function with the expected parameters, the attributes and
constants the fix relies on) and raises :class:`~outbox.errors.KafkaClientIncompatible`,
patching nothing, when one is missing or changed: a kafka-python release that moves a module
must stop the process at start, not drop a fix unnoticed.

Each bug, with a reproduction to report it upstream: docs/operations.md, "kafka-python bugs
outboxkit works around".
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from outbox.errors import KafkaClientIncompatible

_MARK = "_outboxkit_fixed"

# The kafka-python releases these fixes were written and tested against; keep it equal to
# the dependency in pyproject.toml (a unit test compares them).
SUPPORTED = "kafka-python>=3.0.12,<3.1"


@dataclass(frozen=True)
class _Fix:
    """One wrapper, and what it relies on in kafka-python."""

    name: str
    module: str
    classes: tuple[str, ...]
    attribute: str
    parameters: tuple[str, ...]  # the original's parameter names, in order
    make: Callable[[Any], Any]
    coroutine: bool = False
    # Names the fix relies on that a signature does not show: instance attributes the
    # wrapper reads, and names or constants the original uses to report what the wrapper
    # recognises. Looked for in the code of the class (and its bases).
    class_uses: tuple[str, ...] = ()
    original_uses: tuple[str, ...] = ()


def _fixes() -> tuple[_Fix, ...]:
    return (
        _Fix("the bytes that arrive together with a close", "kafka.net.transport",
             ("KafkaTCPTransport", "KafkaSSLTransport"), "_sock_recv", ("self",),
             _keeping_data, original_uses=("KafkaConnectionError", "socket disconnected")),
        _Fix("a join in flight that nobody finishes", "kafka.coordinator.consumer",
             ("ConsumerCoordinator",), "need_rejoin", ("self",), _pending_join_counts,
             class_uses=("rejoining",)),
        _Fix("a socket left open by a connection attempt that did not finish",
             "kafka.net.inet", ("KafkaNetSocket",), "sock_connect",
             ("self", "net", "sock", "sockaddr", "timeout_at"), _closing_on_failure,
             coroutine=True),
        _Fix("a paused partition whose fetched data is never handed back",
             "kafka.consumer.fetcher", ("Fetcher",), "fetched_records",
             ("self", "max_records", "update_offsets"), _resuming_kept_data,
             class_uses=("_next_partition_records",)),
        _Fix("a broker that hangs asked again at once", "kafka.net.manager",
             ("KafkaConnectionManager",), "least_loaded_node", ("self",),
             _preferring_connections,
             original_uses=("_conns", "brokers", "connected", "connection_delay",
                            "in_flight_requests", "paused")),
    )


def install() -> None:
    """Apply the five fixes, once per process (idempotent).

    Raises :class:`~outbox.errors.KafkaClientIncompatible`, before patching anything, when
    an internal a fix relies on is missing or changed; the check runs on every call, also
    after the fixes are in (it looks through them to kafka-python's originals).
    """
    problems: list[str] = []
    todo: list[tuple[type, _Fix, Any]] = []  # (class, fix, kafka-python's original)
    for fix in _fixes():
        todo += [(cls, fix, original) for cls, original, fixed in _originals(fix, problems)
                 if not fixed]
    if problems:
        raise KafkaClientIncompatible(_version(), problems, SUPPORTED)
    # Every wrapper is made before any is set, so that nothing is half installed.
    made = []
    for cls, fix, original in todo:
        try:
            made.append((cls, fix.attribute, fix.make(original)))
        except (ImportError, AttributeError) as exc:  # what a wrapper looks up in kafka-python
            problem = f"the fix for {fix.name} cannot be made: {exc!r}"
            raise KafkaClientIncompatible(_version(), [problem], SUPPORTED) from exc
    for cls, attribute, wrapped in made:
        setattr(wrapped, _MARK, True)
        setattr(cls, attribute, wrapped)


def _originals(fix: _Fix, problems: list[str]) -> Iterator[tuple[type, Any, bool]]:
    """Each class of *fix*, kafka-python's original, and whether the fix is in already.

    What is missing or changed goes to *problems* instead.
    """
    where = f"{fix.module}.{{}}.{fix.attribute} (the fix for {fix.name})"
    try:
        module = importlib.import_module(fix.module)
    except ImportError as exc:
        problems.append(f"module {fix.module} (the fix for {fix.name}) does not import: {exc}")
        return
    for name in fix.classes:
        cls = getattr(module, name, None)
        if not isinstance(cls, type):
            problems.append(f"class {fix.module}.{name} (the fix for {fix.name}) is missing")
            continue
        try:
            # Also found on a base class: kafka-python may move a method up without harm.
            found = inspect.getattr_static(cls, fix.attribute)
        except AttributeError:
            problems.append(f"{where.format(name)} is missing")
            continue
        fixed = getattr(found, _MARK, False)
        original = found.__wrapped__ if fixed else found
        problem = _changed(fix, cls, original)
        if problem:
            problems.append(f"{where.format(name)} {problem}")
        else:
            yield cls, original, fixed


def _changed(fix: _Fix, cls: type, original: Any) -> str | None:
    """How *original* differs from what the fix expects, or None."""
    if not isinstance(original, types.FunctionType):
        return f"is not a plain function any more (it is {type(original).__name__})"
    if fix.coroutine != inspect.iscoroutinefunction(original):
        return "is no longer a coroutine function" if fix.coroutine else (
            "became a coroutine function")
    parameters = tuple(inspect.signature(original, follow_wrapped=False).parameters)
    if parameters != fix.parameters:
        return (f"has changed its parameters: ({', '.join(parameters)}), the fix expects "
                f"({', '.join(fix.parameters)})")
    missing = [n for n in fix.original_uses if n not in _names(original.__code__)]
    missing += [n for n in fix.class_uses if n not in _class_names(cls)]
    if missing:
        return "no longer uses " + ", ".join(repr(n) for n in missing)
    return None


def _class_names(cls: type) -> set[str]:
    """The names and constants used by the functions of *cls* and its bases."""
    found: set[str] = set()
    for klass in cls.__mro__:
        for value in vars(klass).values():
            parts = (value.fget, value.fset) if isinstance(value, property) else (value,)
            for part in parts:
                # Through a fix already installed, to kafka-python's own code.
                code = getattr(inspect.unwrap(part) if callable(part) else part,
                               "__code__", None)
                if isinstance(code, types.CodeType):
                    found |= _names(code)
    return found


def _names(code: types.CodeType) -> set[str]:
    """The names and string constants a code object (and the code nested in it) uses."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, str):
            found.add(const)
        elif isinstance(const, types.CodeType):
            found |= _names(const)
    return found


def _version() -> str:
    try:
        return str(importlib.import_module("kafka").__version__)
    except (ImportError, AttributeError) as exc:
        return f"unknown ({exc})"


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


def _preferring_connections(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def least_loaded_node(self: Any) -> Any:
        """A connected node, fewest requests in flight first (random among equals, as
        kafka-python's, so that lookups spread over the brokers); kafka-python's own choice
        when none is connected. A connection being made is not preferred: after a timeout,
        the node being connected again is likely the one that hangs."""
        nodes = [broker.node_id for broker in self.cluster.brokers()]
        random.shuffle(nodes)
        ready, fewest = None, float("inf")
        for node_id in nodes:
            conn = self._conns.get(node_id)
            if conn is None or not conn.connected or conn.paused:
                continue
            in_flight = len(conn.in_flight_requests)
            if in_flight == 0:
                return node_id
            if in_flight < fewest:
                ready, fewest = node_id, in_flight
        return ready if ready is not None else original(self)

    return least_loaded_node
