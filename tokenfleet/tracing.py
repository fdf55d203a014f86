"""W3C trace context through the queue, and spans exported over OTLP where an endpoint is set.

A request carries a ``traceparent`` (protocol field; the gateway takes the HTTP header or starts
a trace). Whoever handles it records spans as children of that context with the times it already
measures, so a request that waits in Redis, is resumed after a crash and finishes on another
worker shows every part under one trace. OpenTelemetry's SDK is imported only when an endpoint
is configured (``pip install 'tokenfleet[otel]'``); without one nothing is recorded or sent.
"""

from __future__ import annotations

from typing import Any

EXPORT_DELAY_MS = 500  # spans leave within half a second: a worker killed later loses none of them


class Tracer:
    """Spans of one process (``service``), recorded after the fact with explicit times."""

    def __init__(self, provider: Any):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("tokenfleet")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def exporting(cls, service: str, endpoint: str | None) -> Tracer | None:
        """A tracer that sends to ``endpoint`` over OTLP/HTTP, or None where there is none."""
        if not endpoint:
            return None
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise RuntimeError(
                f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'tokenfleet[otel]' ({e})"
            ) from None
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=endpoint)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        return cls(provider)

    def record(
        self,
        name: str,
        parent: str | None,
        start_s: float,
        end_s: float,
        attributes: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> str:
        """A finished span from ``start_s`` to ``end_s`` (Unix seconds) under ``parent`` (a
        traceparent; None: a new trace); returns its own traceparent."""
        span = self.start(name, parent, start_s, attributes)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=int(end_s * 1e9))
        return self.traceparent(span)

    def start(
        self, name: str, parent: str | None, start_s: float, attributes: dict[str, Any] | None = None
    ) -> Any:
        """An open span (end it with ``span.end()``)."""
        context = self._propagator.extract({"traceparent": parent}) if parent else None
        return self.tracer.start_span(
            name, context=context, start_time=int(start_s * 1e9), attributes=attributes
        )

    def traceparent(self, span: Any) -> str:
        ctx = span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def shutdown(self) -> None:
        """Send what is still buffered."""
        self.provider.shutdown()
