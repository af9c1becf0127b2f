"""Does a standard OTel SDK exporter ride out a collector overload without dropping its batch?

A real collector (in this process) refuses everything for D seconds, as when its disk is full
(UNAVAILABLE + RetryInfo on gRPC, 503 + Retry-After on HTTP, with tracerl's growing hints), then
accepts again. At the start of the outage the real ``OTLPSpanExporter`` (gRPC and HTTP, SDK
1.45) exports one batch. Printed per exporter, outage and export timeout: whether the batch got
through, after how long, and how many attempts the collector saw. The exporter's timeout is the
default (``OTEL_EXPORTER_OTLP_TIMEOUT`` unset: 10 s) or raised.

    python bench/overload_retry.py [--outages 5 60] [--timeouts default 120]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector_exporter.testing import running_collector


def spans(n: int = 64) -> list:
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    for i in range(n):
        with tp.get_tracer("bench").start_as_current_span(f"call-{i}"):
            pass
    return list(mem.get_finished_spans())


def ride_out(outage_s: float, timeout: float | None) -> list[dict]:
    """One outage, both exporters exporting concurrently from its start."""
    store = Path(tempfile.mkdtemp(prefix="bench-overload-")) / "store"
    with running_collector(store) as c:
        guard = c.ingest.overload
        guard.min_free = 1 << 60  # no disk is that large: refused as "disk full", nothing drains
        guard._at = 0.0  # re-measure now
        refused_before = c.ingest.stats.refused_overload
        exporters = {
            "grpc": GrpcExporter(
                endpoint=c.grpc_endpoint.removeprefix("http://"), insecure=True, timeout=timeout
            ),
            "http": HttpExporter(endpoint=c.http_endpoint + "/v1/traces", timeout=timeout),
        }
        results: dict[str, dict] = {}

        def run(name: str) -> None:
            t0 = time.monotonic()
            ok = exporters[name].export(spans()) == SpanExportResult.SUCCESS
            results[name] = {"exporter": name, "ok": ok, "after_s": time.monotonic() - t0}

        threads = [threading.Thread(target=run, args=(n,)) for n in exporters]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while time.monotonic() - t0 < outage_s and any(t.is_alive() for t in threads):
            time.sleep(0.05)
        guard.min_free, guard._at = 0, 0.0  # the disk has room again
        for t in threads:
            t.join()
        refused = c.ingest.stats.refused_overload - refused_before
        for e in exporters.values():
            e.shutdown()
    for r in results.values():
        r.update(outage_s=outage_s, timeout=timeout or "default (10)", refused_total=refused)
    return list(results.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outages", type=float, nargs="*", default=[5, 60])
    ap.add_argument("--timeouts", nargs="*", default=["default", "120"])
    args = ap.parse_args()
    rows = []
    for timeout in args.timeouts:
        for outage in args.outages:
            rows += ride_out(outage, None if timeout == "default" else float(timeout))
    print(f"{'exporter':<8} {'timeout s':>12} {'outage s':>8} {'batch':>9} {'after s':>8} {'refusals':>8}")
    for r in rows:
        print(
            f"{r['exporter']:<8} {r['timeout']!s:>12} {r['outage_s']:>8g} {'delivered' if r['ok'] else 'DROPPED':>9} "
            f"{r['after_s']:>8.1f} {r['refused_total']:>8}"
        )


if __name__ == "__main__":
    main()
