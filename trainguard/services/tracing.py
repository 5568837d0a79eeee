"""OpenTelemetry spans for event handling, parented by the W3C trace context every event
carries (``event.trace["traceparent"]``), so one trace spans fault → anomaly → verdict →
decision → action across the services.

Off by default (zero cost). ``TG_OTEL=console`` prints finished spans to stderr with the SDK's
console exporter; ``configure(exporter)`` installs any SDK span exporter (an OTLP exporter from
``opentelemetry-exporter-otlp`` if you install it, or an in-memory one in tests).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Callable

_provider = None


def configure(exporter=None, service: str = "trainguard") -> None:
    """Install a tracer provider exporting to ``exporter`` (default: console)."""
    global _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(SimpleSpanProcessor(exporter or ConsoleSpanExporter()))


def enabled() -> bool:
    return _provider is not None


def configure_from_env(service: str) -> None:
    """Honour ``TG_OTEL`` (``console``); does nothing when unset."""
    if os.environ.get("TG_OTEL", "").lower() == "console" and _provider is None:
        configure(service=service)


def traced(service: str, handler: Callable) -> Callable:
    """Wrap a bus handler ``handler(subject, event)`` so each call is a span named
    ``<service> <schema>`` whose parent is the event's trace context. Returns ``handler``
    itself when tracing is off."""
    if _provider is None:
        return handler
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer = _provider.get_tracer(f"trainguard.{service}")
    prop = TraceContextTextMapPropagator()

    async def _wrapped(subject: str, event: Any) -> None:
        ctx = prop.extract(carrier=dict(getattr(event, "trace", {}) or {}))
        with tracer.start_as_current_span(f"{service} {event.SCHEMA}", context=ctx) as span:
            span.set_attribute("messaging.destination", subject)
            span.set_attribute("trainguard.event_id", event.event_id)
            if event.job:
                span.set_attribute("trainguard.job", event.job)
            res = handler(subject, event)
            if asyncio.iscoroutine(res):
                await res

    return _wrapped
