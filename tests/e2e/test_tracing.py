"""One trace from the agent's decision to the consumer's effect: decide → emit → publish → handle.

A real OpenTelemetry SDK provider with an in-memory exporter; the relay and the consumer run
in-process (threads), but the trace context reaches them only through the outbox row's and the
Kafka record's ``traceparent`` headers, as it would across processes.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Engine, text

from consumers import Consumer, HandlerContext
from outbox.db.dsn import sqlalchemy_url
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from relay import Relay, RelaySettings
from tests.e2e.conftest import read_topic, wait_until
from tests.e2e.consumer_app import Item
from tests.e2e.consumer_support import InProcess, settings
from tests.tracing_support import installed_provider

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with installed_provider() as exporter:
        yield exporter


class InProcessRelay:
    """A :class:`Relay` in a thread; ``stop()`` joins it."""

    def __init__(self, database_url: str, bootstrap: str) -> None:
        self.relay = Relay(
            RelaySettings(
                database_url=sqlalchemy_url(database_url),
                kafka_bootstrap=bootstrap,
                relay_id=f"relay-{uuid.uuid4().hex[:6]}",
                lane_lease_seconds=3,
                poll_interval_seconds=0.2,
                create_topics=False,
            )
        )
        self.thread = threading.Thread(target=self.relay.run, daemon=True)

    def __enter__(self) -> InProcessRelay:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.relay.stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the relay did not stop within 60 s"


def by_name(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def traceparent_of(span: ReadableSpan) -> str:
    c = span.context
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def test_decide_emit_publish_handle_is_one_trace_with_each_span_the_child_of_the_one_before(
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    kafka_topic: Callable[..., str],
    spans: InMemorySpanExporter,
) -> None:
    topic = kafka_topic(partitions=1)
    handled: list[str] = []

    def handle(ctx: HandlerContext, item: Item) -> None:
        # The handler runs inside outbox.handle: its own spans (and follow-ups) join the trace.
        handled.append(format(trace.get_current_span().get_span_context().span_id, "016x"))

    app = Consumer(
        group_id=f"g-{uuid.uuid4().hex[:8]}", settings=settings(database_url, kafka_bootstrap)
    )
    app.register(topic, handle)

    with trace.get_tracer("agent").start_as_current_span("agent.decide"), engine.begin() as conn:
        message_id = emit(conn, Envelope(topic=topic, type="item", key="k1", payload={"n": 1}))

    with InProcessRelay(database_url, kafka_bootstrap), InProcess(app):
        wait_until(lambda: bool(by_name(spans, "outbox.handle")), 30, "the message handled")

    (decide,) = by_name(spans, "agent.decide")
    (emitted,) = by_name(spans, "outbox.emit")
    (published,) = by_name(spans, "outbox.publish")
    (handled_span,) = by_name(spans, "outbox.handle")
    chain = [decide, emitted, published, handled_span]

    assert {s.context.trace_id for s in chain} == {decide.context.trace_id}
    assert decide.parent is None
    for parent, child in itertools.pairwise(chain):
        assert child.parent is not None, child.name
        assert child.parent.span_id == parent.context.span_id, f"{child.name} under {parent.name}"
    assert handled == [format(handled_span.context.span_id, "016x")]

    # The links are the headers, not ambient context: the outbox row carries the emit's
    # traceparent, the Kafka record the publish's.
    with engine.connect() as conn:
        stored = conn.execute(
            text(
                "SELECT headers->>'traceparent' FROM outboxkit.outbox_messages"
                " WHERE message_id = :m"
            ),
            {"m": message_id},
        ).scalar_one()
    assert stored == traceparent_of(emitted)
    (record,) = read_topic(kafka_bootstrap, topic)
    assert dict(record.headers)["traceparent"].decode() == traceparent_of(published)

    assert emitted.kind is SpanKind.INTERNAL
    assert emitted.attributes is not None
    assert emitted.attributes["messaging.destination.name"] == topic
    assert emitted.attributes["messaging.message.id"] == str(message_id)
    assert published.kind is SpanKind.PRODUCER
    assert published.attributes is not None
    assert published.attributes["messaging.destination.partition.id"] == str(record.partition)
    assert published.attributes["messaging.kafka.offset"] == record.offset
    assert handled_span.kind is SpanKind.CONSUMER
    assert handled_span.attributes is not None
    assert handled_span.attributes["messaging.message.id"] == str(message_id)
    assert handled_span.status.status_code is StatusCode.UNSET


def test_a_failing_handler_leaves_an_error_span_per_attempt(
    engine: Engine,
    database_url: str,
    kafka_bootstrap: str,
    kafka_topic: Callable[..., str],
    spans: InMemorySpanExporter,
) -> None:
    topic = kafka_topic(partitions=1)

    def handle(ctx: HandlerContext, item: Item) -> None:
        raise RuntimeError(f"item {item.n} fails")

    app = Consumer(
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        settings=settings(database_url, kafka_bootstrap, max_attempts=2),
    )
    app.register(topic, handle)
    with engine.begin() as conn:
        emit(conn, Envelope(topic=topic, type="item", key="k1", payload={"n": 1}))

    with InProcessRelay(database_url, kafka_bootstrap), InProcess(app):
        wait_until(lambda: len(by_name(spans, "outbox.handle")) >= 2, 30, "two attempts")

    (published,) = by_name(spans, "outbox.publish")
    attempts = by_name(spans, "outbox.handle")
    for attempt in attempts:
        assert attempt.status.status_code is StatusCode.ERROR
        assert attempt.status.description == "RuntimeError: item 1 fails"
        assert attempt.parent is not None
        assert attempt.parent.span_id == published.context.span_id
