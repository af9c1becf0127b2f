"""Span factories for collector tests: real SDK spans, encoded by the SDK's own OTLP encoder."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def make_spans(n: int, resource: dict | None = None, attrs: dict | None = None) -> list[ReadableSpan]:
    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create(resource or {"service.name": "test-agent"}))
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("tests.collector", "1.2.3")
    for i in range(n):
        with tracer.start_as_current_span(f"step-{i}", attributes={"i": i, **(attrs or {})}):
            pass
    return list(mem.get_finished_spans())


def trace_request(n: int, **kw) -> ExportTraceServiceRequest:
    return encode_spans(make_spans(n, **kw))


def span_key(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
