"""A real OpenTelemetry SDK provider with an in-memory exporter, installed for one test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


def _reset_global_provider() -> None:
    # OpenTelemetry lets a process set its global provider once (a second set is ignored
    # with a warning) and offers no public reset. A test needs one only for its duration,
    # and must leave none behind for the tests after it, so reset the private once-guard.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@contextlib.contextmanager
def installed_provider() -> Iterator[InMemorySpanExporter]:
    """A global ``TracerProvider`` exporting to memory (synchronously) for the block."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _reset_global_provider()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        _reset_global_provider()
        provider.shutdown()
