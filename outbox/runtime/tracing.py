"""OpenTelemetry spans for emit, publish and handle: optional, and free when unused.

OpenTelemetry is an optional dependency (``pip install outboxkit[otel]``). Without it
installed, or with it installed but no tracer provider configured by the application, every
helper here returns at once without creating anything: :func:`tracer` is ``None`` and
:func:`start_span` is a shared ``nullcontext``. The library never configures a provider or
an exporter; the application does.

Trace context crosses the outbox and Kafka as W3C ``traceparent``/``tracestate`` headers:
``outbox.emit`` writes its own context into the envelope, the relay's ``outbox.publish``
span is its child and replaces the header with its own context on the Kafka record, and the
consumer's ``outbox.handle`` span is the child of that. Decision → emit → publish → handle
is then one trace, however long the message waited in the outbox.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

TRACER_NAME = "outboxkit"
HEADER_TRACEPARENT = "traceparent"
HEADER_TRACESTATE = "tracestate"
TRACE_HEADERS = frozenset({HEADER_TRACEPARENT, HEADER_TRACESTATE})

SpanKind = Literal["internal", "producer", "consumer"]
Headers = Mapping[str, Any] | Iterable[tuple[str, Any]]

_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
_cached: tuple[Any, Any] | None = None  # (provider, its "outboxkit" tracer)


class _Api:
    """The few OpenTelemetry objects outboxkit uses, imported once."""

    def __init__(self) -> None:
        self.trace = importlib.import_module("opentelemetry.trace")
        tracecontext = importlib.import_module("opentelemetry.trace.propagation.tracecontext")
        # W3C explicitly, not the global propagator: the header names are fixed by the
        # envelope, whatever propagators the application configured for its own transports.
        self.propagator = tracecontext.TraceContextTextMapPropagator()
        self.unset = (self.trace.ProxyTracerProvider, self.trace.NoOpTracerProvider)
        self.kinds = {
            "internal": self.trace.SpanKind.INTERNAL,
            "producer": self.trace.SpanKind.PRODUCER,
            "consumer": self.trace.SpanKind.CONSUMER,
        }


@functools.cache
def _api() -> _Api | None:
    # Looked up once: a failed import on every message would search sys.path every time.
    try:
        return _Api()
    except ImportError:
        return None


def tracer() -> Any | None:
    """The ``outboxkit`` tracer, or None when OpenTelemetry is absent or no provider is set.

    Checked on every call (a dict lookup and an ``isinstance``), so a provider the
    application sets after importing outboxkit is picked up.
    """
    global _cached  # noqa: PLW0603 - a one-slot cache of the provider's tracer
    api = _api()
    if api is None:
        return None
    provider = api.trace.get_tracer_provider()
    if isinstance(provider, api.unset):
        return None
    cached = _cached
    if cached is not None and cached[0] is provider:
        return cached[1]
    found = provider.get_tracer(TRACER_NAME, _version())
    _cached = (provider, found)
    return found


def enabled() -> bool:
    """Whether spans are being created (OpenTelemetry installed and a provider configured)."""
    return tracer() is not None


def start_span(
    name: str,
    *,
    kind: SpanKind = "internal",
    parent: Headers | None = None,
    links: Iterable[Headers] = (),
    ok: tuple[type[BaseException], ...] = (),
) -> contextlib.AbstractContextManager[Any]:
    """A span made current for the ``with`` block; yields it, or None when tracing is off.

    Args:
        parent: headers carrying the parent's ``traceparent`` (the span is then the child of
            that context, not of the current span); None: the current span is the parent.
        links: headers of further contexts the span is linked to (a batch's messages).
        ok: exceptions that are outcomes, not errors: they pass without an error status.
    """
    found = tracer()
    if found is None:
        return _NO_SPAN
    return _current_span(found, name, kind=kind, parent=parent, links=links, ok=ok)


@contextlib.contextmanager
def _current_span(
    found: Any,
    name: str,
    *,
    kind: SpanKind,
    parent: Headers | None,
    links: Iterable[Headers],
    ok: tuple[type[BaseException], ...],
) -> Iterator[Any]:
    api = _api()
    assert api is not None
    with found.start_as_current_span(
        name,
        **_placement(api, kind, parent),
        links=_links(api, links),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except ok:
            raise
        except Exception as exc:
            record_error(span, exc)
            raise


def start_detached(
    name: str, *, kind: SpanKind = "internal", parent: Headers | None = None
) -> Any | None:
    """A started span that is not made current (end it with :func:`finish`); None when off.

    For spans that overlap on one thread, such as one per message of a batch in flight.
    """
    found = tracer()
    if found is None:
        return None
    api = _api()
    assert api is not None
    return found.start_span(name, **_placement(api, kind, parent))


def set_attributes(span: Any | None, attributes: Mapping[str, Any]) -> None:
    """Set *attributes* on *span*, skipping None values; nothing when *span* is None."""
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def record_error(span: Any | None, error: BaseException | str) -> None:
    """Record *error* on *span* and set its status to ERROR; nothing when *span* is None."""
    api = _api()
    if span is None or api is None:
        return
    if isinstance(error, BaseException):
        span.record_exception(error)
        description = f"{type(error).__name__}: {error}"
    else:
        description = error
    span.set_status(api.trace.Status(api.trace.StatusCode.ERROR, description[:1000]))


def finish(span: Any | None, *, error: BaseException | str | None = None) -> None:
    """End a span from :func:`start_detached`, with an error status if *error* is given."""
    if span is None:
        return
    if error is not None:
        record_error(span, error)
    span.end()


def trace_headers(span: Any | None = None) -> dict[str, str]:
    """W3C ``traceparent``/``tracestate`` of *span* (default: the current span), if valid.

    Empty when OpenTelemetry is absent or there is no valid span context to propagate.
    """
    api = _api()
    if api is None:
        return {}
    carrier: dict[str, str] = {}
    context = None if span is None else api.trace.set_span_in_context(span)
    api.propagator.inject(carrier, context=context)
    return carrier


def _placement(api: _Api, kind: SpanKind, parent: Headers | None) -> dict[str, Any]:
    """A new span's kind and parent context: *parent*'s when given, else the current span."""
    return {"context": None if parent is None else _extract(api, parent), "kind": api.kinds[kind]}


def _extract(api: _Api, headers: Headers) -> Any:
    """The context carried by *headers* (a mapping or Kafka's (name, bytes) pairs).

    Without a valid ``traceparent`` this is an empty context: the span becomes a root,
    rather than silently the child of whatever span happens to be current.
    """
    items = headers.items() if isinstance(headers, Mapping) else headers
    carrier: dict[str, str] = {}
    for name, value in items:
        if name in TRACE_HEADERS and value is not None:
            carrier[name] = value if isinstance(value, str) else bytes(value).decode("latin-1")
    return api.propagator.extract(carrier)


def _links(api: _Api, headers: Iterable[Headers]) -> list[Any]:
    links = []
    for carried in headers:
        context = api.trace.get_current_span(_extract(api, carried)).get_span_context()
        if context.is_valid:
            links.append(api.trace.Link(context))
    return links


@functools.cache
def _version() -> str | None:
    try:
        return importlib.metadata.version("outboxkit")
    except importlib.metadata.PackageNotFoundError:
        return None
