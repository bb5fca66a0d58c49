"""Tracing a request across the processes that serve it, with OpenTelemetry (vLLM's `--otlp-traces-endpoint`).

Off unless a process is given an endpoint: then spans go to that OTLP collector, over gRPC (the default, port
4317) or over HTTP with protobuf bodies when `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` or the endpoint
ends in `/v1/traces` (port 4318), batched off the hot path (the SDK's BatchSpanProcessor).

The context travels as a W3C `traceparent`: a client's header (HTTP) or metadata (gRPC) makes the gateway's span
its child; the gateway hands each node call its hop's span in the request message's `traceparent` field; a node's
spans are children of that. One request is so one trace: gateway (llm_request, route, reserve, prefill, decode,
migrate) -> prefill node (node.prefill, kv_transfer) and decode node (node.reserve, node.generate, kv_receive).

Spans here are never the "current" span: each is started with an explicit parent and ended explicitly, so a span
can live across the yields of a token stream (attaching a context in an async generator and detaching it in
another task is an error in OpenTelemetry). Disabled, every function is a no-op returning None: tracing costs a
process that does not trace nothing but a None check.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

logger = logging.getLogger(__name__)

_enabled = False
_provider = None
# The traceparent a client sent with the request being served (set by the API layer, read where its span starts).
incoming_traceparent: ContextVar[str] = ContextVar("kvrelay_incoming_traceparent", default="")


def setup_tracing(service_name: str, endpoint: str | None, attributes: dict[str, str] | None = None) -> bool:
    """Export this process's spans to `endpoint` (None: tracing stays off). True when on."""
    global _enabled, _provider
    if not endpoint:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "")
    if protocol == "http/protobuf" or endpoint.rstrip("/").endswith("/v1/traces"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = endpoint.startswith("http://") or "://" not in endpoint
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    resource = Resource.create({"service.name": service_name, **(attributes or {})})
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(_provider)
    _enabled = True
    logger.info("tracing to %s as %s", endpoint, service_name)
    return True


def shutdown_tracing() -> None:
    """Send what is buffered (a process's last spans) and stop."""
    global _enabled
    if _provider is not None and _enabled:
        _provider.shutdown()
    _enabled = False


def enabled() -> bool:
    return _enabled


def _tracer():
    from opentelemetry import trace

    return trace.get_tracer("kvrelay")


def parent_from(traceparent: str):
    """The context a W3C traceparent names (None: no valid parent, or tracing off)."""
    if not _enabled or not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def request_parent(traceparent: str):
    """The parent of a request's span: the current span if a framework started one (FastAPI's HTTP server span,
    itself the child of the client's traceparent), else the client's traceparent, else None (a new trace)."""
    if not _enabled:
        return None
    from opentelemetry import context, trace

    if trace.get_current_span().get_span_context().is_valid:
        return context.get_current()
    return parent_from(traceparent)


def start_span(name: str, parent: Any = None, attributes: dict[str, Any] | None = None, server: bool = False):
    """A span, child of `parent` (a span, a context from `parent_from`, or None: a new trace); None when off."""
    if not _enabled:
        return None
    from opentelemetry import trace

    if parent is not None and not isinstance(parent, dict) and hasattr(parent, "get_span_context"):
        parent = trace.set_span_in_context(parent)
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    return _tracer().start_span(name, context=parent, kind=kind, attributes=_clean(attributes))


def traceparent(span) -> str:
    """The W3C traceparent naming `span` as the parent ("" for None)."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def end(span, attributes: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


@contextmanager
def span(name: str, parent: Any = None, attributes: dict[str, Any] | None = None, server: bool = False):
    """start_span ... end, around a block (an exception marks the span failed and goes on)."""
    s = start_span(name, parent, attributes, server)
    try:
        yield s
    except BaseException as e:
        end(s, error=e)
        raise
    end(s)


def _clean(attributes: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenTelemetry takes str, bool, int, float and sequences of them; None values are left out."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
