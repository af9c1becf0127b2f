"""The sweep's gateway process (bench/gateway_rig.py) exports its spans as production does, short of the network."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"


def test_the_sweeps_span_exporter_encodes_every_span_as_otlp_and_keeps_none():
    """The sweep's gateway exports through ``EncodingExporter``: production's encoding work, no span kept."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    sys.path.insert(0, str(BENCH.parent))
    try:
        from gateway_rig import EncodingExporter, exporting_provider
    finally:
        sys.path.remove(str(BENCH.parent))
    memory = InMemorySpanExporter()
    made = TracerProvider()
    made.add_span_processor(SimpleSpanProcessor(memory))
    for i in range(7):
        with made.get_tracer("t").start_as_current_span(f"call {i}") as span:
            span.set_attribute("tracerl.response_token_ids", list(range(16)))
    spans = memory.get_finished_spans()
    exporter = EncodingExporter()
    exporter.export(spans)
    req = ExportTraceServiceRequest()
    wire = encode_spans(spans).SerializeToString()
    req.ParseFromString(wire)
    assert exporter.spans == 7 and exporter.encoded_bytes == len(wire)
    assert [s.name for s in req.resource_spans[0].scope_spans[0].spans] == [f"call {i}" for i in range(7)]

    provider, counted = exporting_provider()  # the sweep's wiring: batched, counted, nothing kept
    with provider.get_tracer("t").start_as_current_span("one"):
        pass
    provider.force_flush()
    assert counted.spans == 1 and not hasattr(counted, "get_finished_spans")


def test_the_wake_up_calibration_measures_cpu_per_wake_of_a_bare_loop():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tracerl_bench_gateway_wake", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    back_to_back = bench.wake_cpu_us(0, 500)
    spaced = bench.wake_cpu_us(0.002, 20)
    assert 0 < back_to_back < 200, back_to_back  # a few us on any machine; bounded loosely for a loaded one
    assert spaced > 0


def test_the_gc_pause_log_counts_each_pass_by_generation_with_what_it_freed():
    """``GCPauses`` sees every pass (a forced full one and the cycles it frees) and says so per generation."""
    import gc

    sys.path.insert(0, str(BENCH.parent))
    try:
        from gateway_rig import GCPauses
    finally:
        sys.path.remove(str(BENCH.parent))
    pauses = GCPauses()
    gc.callbacks.append(pauses)
    try:
        for _ in range(50):  # 50 two-object cycles, garbage once the loop drops them
            a: list = []
            b = [a]
            a.append(b)
        del a, b
        gc.collect(2)
    finally:
        gc.callbacks.remove(pauses)
    full = pauses.passes[2]
    assert len(full) >= 1 and full[-1][1] >= 0 and full[-1][2] >= 100
    assert f"gen2 {len(full)} passes" in pauses.summary()
