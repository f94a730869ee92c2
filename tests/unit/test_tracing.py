"""outbox.runtime.tracing: no-ops without OpenTelemetry or a provider; real spans with one."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outbox.runtime import tracing
from tests.tracing_support import installed_provider

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with installed_provider() as exporter:
        yield exporter


@pytest.fixture
def without_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As if opentelemetry were not installed: its import fails."""
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", None)
    tracing._api.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        tracing._api.cache_clear()


def assert_no_op() -> None:
    assert tracing.tracer() is None
    assert not tracing.enabled()
    with tracing.start_span("x", kind="consumer", parent={"traceparent": TRACEPARENT}) as span:
        assert span is None
    assert tracing.start_detached("x", parent={"traceparent": TRACEPARENT}) is None
    tracing.set_attributes(None, {"a": 1})
    tracing.finish(None, error=RuntimeError("ignored"))
    assert tracing.trace_headers() == {}


class TestOff:
    def test_without_a_provider_every_helper_is_a_no_op(self) -> None:
        """OpenTelemetry installed, but the application configured no provider."""
        assert_no_op()
        # The shared null context: no object is made per call.
        assert tracing.start_span("a") is tracing.start_span("b")

    @pytest.mark.usefixtures("without_opentelemetry")
    def test_without_opentelemetry_every_helper_is_a_no_op(self) -> None:
        assert tracing._api() is None
        assert_no_op()

    def test_an_exception_passes_through_the_no_op_span(self) -> None:
        with pytest.raises(KeyError), tracing.start_span("x"):
            raise KeyError("k")


class TestOn:
    def test_a_span_is_the_child_of_the_traceparent_it_is_given(
        self, spans: InMemorySpanExporter
    ) -> None:
        with tracing.start_span("child", kind="consumer", parent={"traceparent": TRACEPARENT}):
            pass
        (span,) = spans.get_finished_spans()
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is not None
        assert f"{span.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
        assert f"{span.parent.span_id:016x}" == "b7ad6b7169203331"

    def test_kafka_style_byte_headers_carry_the_parent_too(
        self, spans: InMemorySpanExporter
    ) -> None:
        kafka_headers = [("message-id", b"m"), ("traceparent", TRACEPARENT.encode())]
        span = tracing.start_detached("p", kind="producer", parent=kafka_headers)
        headers = tracing.trace_headers(span)
        tracing.finish(span)
        (finished,) = spans.get_finished_spans()
        assert finished.parent is not None
        assert f"{finished.parent.span_id:016x}" == "b7ad6b7169203331"
        assert headers["traceparent"].startswith(
            f"00-0af7651916cd43dd8448eb211c80319c-{finished.context.span_id:016x}-"
        )

    def test_an_error_sets_the_error_status_and_an_ok_exception_does_not(
        self, spans: InMemorySpanExporter
    ) -> None:
        with pytest.raises(RuntimeError), tracing.start_span("failing"):
            raise RuntimeError("boom")
        with pytest.raises(KeyError), tracing.start_span("skipped", ok=(KeyError,)):
            raise KeyError("fine")
        failing, skipped = spans.get_finished_spans()
        assert failing.status.status_code is StatusCode.ERROR
        assert [e.name for e in failing.events] == ["exception"]
        assert skipped.status.status_code is StatusCode.UNSET
        assert not skipped.events

    def test_a_headerless_parent_makes_a_root_span_not_a_child_of_the_current_one(
        self, spans: InMemorySpanExporter
    ) -> None:
        with tracing.start_span("outer"), tracing.start_span("inner", parent={}):
            pass
        inner, _outer = spans.get_finished_spans()
        assert inner.parent is None
