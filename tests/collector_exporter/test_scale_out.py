"""``examples/scale_out/otelcol.yaml``: the OpenTelemetry Collector's loadbalancing exporter in front
of two tracerl collectors on one store. Every span arrives exactly once, and all spans of a trace
were stored by the same tracerl collector (routing by traceID).

Needs the ``otelcol-contrib`` binary on PATH (it is not on PyPI, and these machines can reach
nothing else), so it skips where the binary is missing; set OTELCOL_CONTRIB to its path.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from tracerl_testing import free_port

from collector_exporter.testing import running_collector
from store.layout import StoreLayout
from store.parquet import read_table

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "scale_out" / "otelcol.yaml"
OTELCOL = os.environ.get("OTELCOL_CONTRIB") or shutil.which("otelcol-contrib")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(OTELCOL is None, reason="otelcol-contrib is not installed (not on PyPI)")]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_loadbalancing_by_trace_id_keeps_each_trace_on_one_collector(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    store = tmp_path / "store"
    front_grpc, front_http = free_port(), free_port()
    with running_collector(store) as a, running_collector(store) as b:
        env = {**os.environ, "OTELCOL_GRPC_ENDPOINT": f"127.0.0.1:{front_grpc}",
               "OTELCOL_HTTP_ENDPOINT": f"127.0.0.1:{front_http}",
               "TRACERL_COLLECTOR_A": a.grpc_endpoint.removeprefix("http://"),
               "TRACERL_COLLECTOR_B": b.grpc_endpoint.removeprefix("http://")}
        otelcol = subprocess.Popen([OTELCOL, "--config", str(CONFIG)], env=env, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while not _listening(front_grpc):
                assert otelcol.poll() is None and time.monotonic() < deadline, otelcol.stderr and otelcol.stderr.read()
                time.sleep(0.2)
            provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
            provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
                endpoint=f"http://127.0.0.1:{front_grpc}", insecure=True)))
            tracer = provider.get_tracer("scale-out-test")
            for t in range(20):
                with tracer.start_as_current_span(f"rollout-{t}"):
                    for c in range(4):
                        with tracer.start_as_current_span(f"call-{c}"):
                            pass
            provider.shutdown()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                a.flush()
                b.flush()
                spans = read_table(StoreLayout.at(store).table("spans"), "spans")
                if len(spans) >= 100:
                    break
                time.sleep(0.5)
        finally:
            otelcol.terminate()
            otelcol.wait(timeout=30)
    files = sorted(StoreLayout.at(store).table("spans").rglob("*.parquet"))
    writer_of: dict[str, set[str]] = {}
    total = 0
    for f in files:
        t = read_table(f, "spans")
        total += len(t)
        for trace_id in set(t.column("trace_id").to_pylist()):
            # part-<writer>-<segment>.parquet: the writer is one tracerl collector
            writer_of.setdefault(trace_id, set()).add(f.name.removesuffix(".parquet").rsplit("-", 1)[0])
    assert total == 100, "every span exactly once"
    assert len(writer_of) == 20
    assert all(len(w) == 1 for w in writer_of.values()), "a trace was split across collectors"
    assert len(set().union(*writer_of.values())) == 2, "both collectors received traffic"
