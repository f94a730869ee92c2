"""The small Kafka client interface outboxkit's daemons use, and the values it passes.

Two backends implement it: kafka-python (:mod:`outbox.kafka.kafka_python`, the default) and
librdkafka through confluent-kafka (:mod:`outbox.kafka.confluent`). The relay, the
consumers, the admin paths and the testing helpers talk to these protocols only, so the
guarantees (idempotent producer with acks=all, evidence per message, offsets committed only
after the database commit, commits before a revocation) are written once and the backend
is one setting (``OUTBOXKIT_KAFKA_CLIENT``).

The interface keeps kafka-python's method names where it had them: the code that called
kafka-python directly reads the same.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from outbox.errors import OutboxError

ClientName = Literal["kafka-python", "confluent"]
CLIENT_NAMES: tuple[ClientName, ...] = ("kafka-python", "confluent")

Headers = list[tuple[str, bytes]]


class TopicPartition(NamedTuple):
    """A partition of a topic. Equal to (and hashed as) kafka-python's ``TopicPartition``:
    both are ``(topic, partition)`` tuples, so either works as a dict key."""

    topic: str
    partition: int


class Record(NamedTuple):
    """A consumed record. kafka-python's ``ConsumerRecord`` has the same attributes and is
    passed through as it is; confluent-kafka's messages are turned into these."""

    topic: str
    partition: int
    offset: int
    timestamp: int  # milliseconds since the epoch (create or log-append time), -1 unknown
    key: bytes | None
    value: bytes | None
    headers: Headers


class Outgoing(NamedTuple):
    """A record to send. ``headers`` is a list of (name, bytes) pairs."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers


@dataclass(slots=True)
class Delivery:
    """What became of one sent record: the broker's proof, or the refusal.

    ``permanent``: trying again cannot change the answer (too large, invalid topic, not
    authorised, a record the broker refuses); everything else is transient. ``too_large``:
    the record (or its batch) is over a size limit, so a smaller copy may still go.
    """

    partition: int = -1
    offset: int = -1
    error: BaseException | None = None
    permanent: bool = False
    too_large: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


# --- errors ------------------------------------------------------------------------------
class KafkaClientError(OutboxError):
    """Anything a Kafka client reported (a broker error, a timeout, a closed connection).

    The backend's own exception is the ``__cause__``; ``code`` is its name for the error
    (kafka-python's exception class name, librdkafka's error code name).
    """

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


NO_OFFSET = "_NO_OFFSET"  # the code of :func:`no_offset`'s error


def no_offset() -> KafkaClientError:
    """A success that names no offset: no proof that the record was written.

    librdkafka's idempotent producer reports a record delivered, without an offset, when a
    later batch of its partition succeeded ("implicitly acked"). It does so also when the
    record's own batch was refused as not persisted: the first batches sent to a topic just
    created went to a leader not serving yet, the one after them was accepted (the broker
    takes any first sequence of a producer it has no state for), and those records were
    never written. Sent again, they are written after later records of their key; lost,
    they would be gone with a proof on record.
    """
    return KafkaClientError(
        "_NO_OFFSET: reported delivered without an offset (the client took a later "
        "batch's success for this record's): not proof that it was written; sent again",
        code=NO_OFFSET)


class TopicExists(KafkaClientError):
    """A topic to create exists already."""


class TopicInvalid(KafkaClientError):
    """A topic name the broker refuses (or a topic it will not create)."""


class CommitRefused(KafkaClientError):
    """An offset commit refused because the group rebalanced: another member owns the
    partition now (it redelivers from the last committed offset; the marks drop them)."""


class UnreadableRecord(KafkaClientError):
    """The client cannot read a record of an assigned partition (corrupt, bad checksum).
    ``partition`` and ``offset`` are set when the client says where."""

    def __init__(
        self, message: str, *, code: str = "", partition: TopicPartition | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.partition, self.offset = partition, offset


class RecordTooLarge(KafkaClientError):
    """A single record that no broker setting lets through as it is."""


# --- options -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Connection:
    """Where the brokers are and how to authenticate (ConnectionSettings' Kafka part)."""

    bootstrap: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str = ""
    sasl_password: str = field(default="", repr=False)
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_check_hostname: bool = True

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.bootstrap.split(",") if s.strip()]


# Below the clients' own 30 s. A broker that hangs (alive, silent: a long GC pause, a stuck
# VM) is fenced by the controller after its session timeout (9 s by default) and its
# partitions get new leaders, but a produce request already sent to it waits for its own
# timeout, and the relay's batch (which waits for all its records) with it. Measured on a
# 3-node cluster with kafka-python, one follower SIGSTOPped while it led a partition the batch
# wrote to: publishing resumed 6.2 s later with 10 s, stayed stuck until SIGCONT (20 s) with
# 30 s. A timed-out request is retried by the idempotent producer: no duplicate, in order.
REQUEST_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class ProducerOptions:
    """An idempotent producer (acks=all) that keeps one batch of a partition in flight:
    confluent-kafka one request per connection, kafka-python up to 5 requests across
    partitions (its sender holds a partition's next batch until the last one is answered)."""

    client_id: str
    linger_ms: int = 0
    batch_bytes: int = 16_384
    compression: str = "none"  # none, gzip, snappy, lz4, zstd
    max_request_bytes: int = 1_048_576
    delivery_timeout_ms: int = 120_000
    # How long one produce request waits for its answer before the client gives up on that
    # broker and retries (within the delivery timeout), asking for fresh metadata.
    request_timeout_ms: int = REQUEST_TIMEOUT_MS
    max_block_ms: int = 10_000

    @property
    def request_timeout_in_delivery_ms(self) -> int:
        """The request timeout, cut to fit in the delivery timeout after the linger
        (kafka-python refuses a delivery timeout below linger + request timeout)."""
        return min(self.request_timeout_ms, max(1, self.delivery_timeout_ms - self.linger_ms))


@dataclass(frozen=True)
class ConsumerOptions:
    """A group member that never commits on its own (outboxkit commits after the database)."""

    group_id: str
    client_id: str
    auto_offset_reset: str = "earliest"
    max_poll_records: int = 500
    session_timeout_ms: int = 45_000
    max_poll_interval_ms: int = 300_000
    metadata_max_age_ms: int = 10_000
    # A fetch sent to a leader that then hung waits this long before the partitions it asked
    # for are fetched from their new leader (kafka-python; a group join waits longer by itself).
    request_timeout_ms: int = REQUEST_TIMEOUT_MS
    extra: Mapping[str, Any] = field(default_factory=dict)  # backend-specific, for tests


# --- the protocols -----------------------------------------------------------------------
class Producer(Protocol):
    def send(
        self,
        records: Iterable[Outgoing],
        *,
        timeout_s: float,
        on_wait: Callable[[float], None] | None = None,
        handed_over: Callable[[], None] | None = None,
    ) -> list[Delivery]:
        """Send *records* in order, wait for every answer (at most *timeout_s*), and return
        one :class:`Delivery` per record, in the same order. *records* is iterated once, each
        sent as it comes (a generator's first record leaves before the last is made). Never
        raises for a record:
        a refusal, or no answer in time (transient), is in its delivery. *on_wait* is called
        about once a second with the seconds waited so far; *handed_over* once, when every
        record is in the client's hands and before any answer is awaited (a crash point the
        fault tests use)."""
        ...

    def partitions_for(self, topic: str) -> set[int] | None:
        """The topic's partitions as this producer's metadata knows them (None: unknown)."""
        ...

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is buffered (at most *timeout_s*), then close. Never raises."""
        ...


class RebalanceListener(Protocol):
    """What a consumer is told of its partitions. Called on the thread that polls."""

    def to_commit(self, revoked: Collection[TopicPartition]) -> Mapping[TopicPartition, int]:
        """Next offsets to commit before *revoked* partitions are given up."""
        ...

    def revoked(
        self,
        partitions: Collection[TopicPartition],
        committed: Mapping[TopicPartition, int],
        error: BaseException | None,
    ) -> None:
        """*partitions* are given up; *committed* is what was committed for them first
        (empty, with the *error*, when that commit failed)."""
        ...

    def lost(self, partitions: Collection[TopicPartition]) -> None:
        """*partitions* were taken away without a chance to commit (presumed dead)."""
        ...

    def assigned(self, partitions: Collection[TopicPartition]) -> None:
        ...


CommitCallback = Callable[[Mapping[TopicPartition, int], BaseException | None], None]


class Consumer(Protocol):
    def subscribe(self, topics: Sequence[str], listener: RebalanceListener) -> None: ...

    def poll(self, timeout_ms: int, max_records: int) -> list[Any]:
        """Records (:class:`Record`-like) of the assigned, unpaused partitions, in each
        partition's order. Raises :class:`UnreadableRecord` for a record it cannot read."""
        ...

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit next offsets and wait. Raises :class:`CommitRefused` after a rebalance,
        :class:`KafkaClientError` otherwise."""
        ...

    def commit_async(self, offsets: Mapping[TopicPartition, int], callback: CommitCallback) -> None:
        """Commit without waiting; *callback* gets the offsets and the error (None if taken)."""
        ...

    def unsubscribe(self) -> None:
        """Leave the group and drop the subscription (failpoint ``consumer.leave_group``)."""
        ...

    def member_id(self) -> str | None:
        """This client's member id in its group; None while it has none."""
        ...

    def pause(self, *partitions: TopicPartition) -> None: ...
    def resume(self, *partitions: TopicPartition) -> None: ...
    def paused(self) -> set[TopicPartition]: ...
    def seek(self, partition: TopicPartition, offset: int) -> None: ...
    def assignment(self) -> set[TopicPartition]: ...

    def position(self, partition: TopicPartition) -> int | None:
        """The offset the next poll reads from (None: not known yet)."""
        ...

    def highwater(self, partition: TopicPartition) -> int | None:
        """The partition's end offset as last seen (None: not known yet)."""
        ...

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        """The topic's partitions; None while unknown (a new topic, or no node answered:
        ask again)."""
        ...

    def close(self) -> None:
        """Leave the group. Both backends tell the listener first that its partitions are
        revoked, and commit its ``to_commit()`` as at any revocation; nothing else is
        committed. Never raises."""
        ...


class Admin(Protocol):
    def list_topics(self) -> set[str]:
        """Every topic of the cluster (a cluster may hold thousands: not for a hot path)."""
        ...

    def existing_topics(self, names: Collection[str]) -> set[str]:
        """Which of *names* exist, asked about them alone, never creating one (whatever the
        broker's ``auto.create.topics.enable``)."""
        ...

    def create_topic(self, name: str, partitions: int = -1, replication: int = -1) -> None:
        """Create *name* (-1: the broker's default). Raises :class:`TopicExists`,
        :class:`TopicInvalid`, :class:`KafkaClientError`."""
        ...

    def topic_configs(
        self, topics: Collection[str], names: Collection[str]
    ) -> dict[str, dict[str, str] | None]:
        """Each existing topic's configuration values *names* (every value, defaults
        included); None for a topic whose configuration the broker did not give."""
        ...

    def replication(self, topic: str) -> tuple[int, int]:
        """The fewest replicas any partition of *topic* has (0: unknown topic), and how
        many brokers the cluster has."""
        ...

    def end_offsets(
        self, partitions: Collection[TopicPartition], timeout_s: float = 15.0
    ) -> dict[TopicPartition, int]:
        """The next offset of each partition (asked of its leader)."""
        ...

    def consumer_groups(self) -> list[str]:
        """The consumer groups the cluster knows (those that commit offsets to Kafka)."""
        ...

    def committed_offsets(self, group: str) -> dict[TopicPartition, int]:
        """Where *group* resumes on each partition it has committed (none: empty)."""
        ...

    def group_members(self, group: str) -> tuple[str, set[str]]:
        """*group*'s state (``stable``, ``empty``, ``dead``, ``rebalancing`` or ``unknown``)
        and its members' ids."""
        ...

    def delete_topics(self, topics: Collection[str]) -> None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """One Kafka client library, bound to a :class:`Connection`."""

    name: ClientName

    def producer(self, options: ProducerOptions) -> Producer: ...
    def consumer(self, options: ConsumerOptions) -> Consumer: ...
    def admin(self, client_id: str, request_timeout_ms: int = 15_000) -> Admin: ...


def group_state(name: str) -> str:
    """A group's state as both clients' admin answers spell it (``Stable``, ``STABLE``,
    ``PreparingRebalance``, ``PREPARING_REBALANCING``, ...), in one spelling."""
    plain = name.replace("_", "").lower()
    if plain in ("stable", "empty", "dead"):
        return plain
    return "rebalancing" if "rebalanc" in plain else "unknown"
