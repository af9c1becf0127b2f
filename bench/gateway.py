"""Added latency of the tracerl gateway: p50/p99 per call through the gateway vs. direct.

Both paths hit the same upstream in one run, interleaved call by call so machine noise hits
both equally. The default upstream is a scripted OpenAI-compatible server (``ScriptedUpstream``)
that answers instantly with vLLM's response shape (``prompt_token_ids``, ``token_ids``,
logprobs), so the numbers are the gateway's own cost; ``--model DIR`` uses the embedded server
with ``max_tokens=1`` instead. The gateway records spans exactly as in production, through a
BatchSpanProcessor (exporting to an in-memory exporter here, so no collector is needed).

    python bench/gateway.py --calls 2000            # target: <= 1 ms p50 added
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serving.gateway import Gateway, GatewayConfig
from serving.httpserver import Server

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _shared
from _shared import percentile


class ScriptedUpstream(_shared.ScriptedUpstream):
    answer = "ok"


def run(calls: int, model_dir: str | None) -> dict[str, float]:
    if model_dir:
        from serving.server import EmbeddedServer

        upstream: Server = EmbeddedServer.start(model_dir)
    else:
        upstream = Server(("127.0.0.1", 0), ScriptedUpstream).start_background()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    gateway = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[upstream.url]), provider).start_background()
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    direct_t, gw_t = [], []
    with httpx.Client(timeout=30) as client:
        for i in range(calls + 50):
            for base, out in ((upstream.url, direct_t), (gateway.url, gw_t)) if i % 2 else \
                    ((gateway.url, gw_t), (upstream.url, direct_t)):
                t = time.perf_counter()
                r = client.post(base + "/v1/chat/completions", json=body)
                dt = time.perf_counter() - t
                r.raise_for_status()
                if i >= 50:  # warm-up
                    out.append(dt)
    deadline = time.monotonic() + 5  # the last span ends just after its response is sent
    while len(exporter.get_finished_spans()) < calls + 50 and time.monotonic() < deadline:
        provider.force_flush()
        time.sleep(0.01)
    spans = len(exporter.get_finished_spans())
    gateway.stop()
    upstream.stop()
    provider.shutdown()
    d50, d99 = statistics.median(direct_t) * 1e3, percentile(direct_t, 0.99) * 1e3
    g50, g99 = statistics.median(gw_t) * 1e3, percentile(gw_t, 0.99) * 1e3
    return {"calls": calls, "spans": spans, "direct_p50_ms": d50, "direct_p99_ms": d99,
            "gateway_p50_ms": g50, "gateway_p99_ms": g99, "added_p50_ms": g50 - d50,
            "added_p99_ms": g99 - d99, "ratio_p50": g50 / d50}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000, help="calls per path (default: %(default)s)")
    ap.add_argument("--model", default=None, help="use the embedded server on this model dir as upstream")
    args = ap.parse_args(argv)
    r = run(args.calls, args.model)
    print(f"calls per path: {r['calls']} (+50 warm-up)  gateway spans recorded: {r['spans']}")
    print(f"direct : p50 {r['direct_p50_ms']:.3f} ms   p99 {r['direct_p99_ms']:.3f} ms")
    print(f"gateway: p50 {r['gateway_p50_ms']:.3f} ms   p99 {r['gateway_p99_ms']:.3f} ms")
    print(f"added  : p50 {r['added_p50_ms']:.3f} ms   p99 {r['added_p99_ms']:.3f} ms   "
          f"ratio p50 {r['ratio_p50']:.2f}x   (target: <= 1 ms p50 added)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
