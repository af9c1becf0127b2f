"""One load-generating client for bench/ingest.py: the real SDK OTLP exporter (gRPC, or HTTP with
protobuf bodies), 512-span batches of LLM-call-like spans, for a fixed time. Prints a JSON summary line.

    python bench/_ingest_client.py HOST:PORT SECONDS BATCH [grpc|http]
"""

import json
import sys
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

PROMPT = ("You are a helpful assistant. " * 40)[:1024]


def llm_call_attributes(i: int) -> dict:
    """The span attributes of one benchmark LLM call (~10, with a 1 KB prompt); bench/ingest.py
    uses the same set for its in-process measurement, so both measure the same workload."""
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "policy@3",
        "gen_ai.system": "openai",
        "gen_ai.prompt": PROMPT,
        "gen_ai.usage.input_tokens": 312 + i,
        "gen_ai.usage.output_tokens": 40,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.response.id": f"chatcmpl-{i}",
        "tracerl.task_id": "t-1",
        "gen_ai.response.finish_reasons": ["stop"],
    }


def main() -> None:
    endpoint, seconds, batch = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    protocol = sys.argv[4] if len(sys.argv) > 4 else "grpc"
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("bench.agent", "1.0")
    if protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        exporter = HTTPExporter(endpoint=f"http://{endpoint}/v1/traces", timeout=30)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=30)
    acked, latencies, failed = 0, [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        mem.clear()
        for i in range(batch):
            with tracer.start_as_current_span("chat policy", attributes=llm_call_attributes(i)):
                pass
        spans = mem.get_finished_spans()
        t0 = time.perf_counter()
        ok = exporter.export(spans) == SpanExportResult.SUCCESS
        latencies.append(time.perf_counter() - t0)
        if ok:
            acked += len(spans)
        else:
            failed += len(spans)
    exporter.shutdown()
    print(json.dumps({"acked": acked, "failed": failed, "latencies": latencies}))


if __name__ == "__main__":
    main()
