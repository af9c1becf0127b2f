"""The processes ``bench/gateway.py`` measures, each run as ``python bench/gateway_rig.py ROLE``: the
streaming upstream (an engine stand-in on the gateway's own HTTP stack) and the gateway (this tree's, as
``tracerl gateway --workers N`` runs it, or an older checkout's with ``BENCH_GATEWAY_ROOT``).

Each server runs in its own process, as in production: the gateway does not share a GIL with the engine
or the clients. A process prints its URL, serves until SIGTERM, and a gateway process then prints how
many spans it exported (through a ``BatchSpanProcessor`` as in production, to an exporter that encodes each
batch as OTLP/gRPC's does and then drops it: ``EncodingExporter``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The gateway process of an --gateway-root run imports serving from that tree; everything else from this one.
sys.path.insert(0, os.environ.get("BENCH_GATEWAY_ROOT") or str(HERE.parent))
sys.path.insert(0, str(HERE))

from _shared import percentile  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

CONNECTIONS = 4096  # connection cap of both servers in the sweep, above its largest client count


def _batched(exporter: SpanExporter) -> TracerProvider:
    """A provider exporting through ``exporter`` in batches, as the gateway does in production (its own
    processor, ``serving.gateway.config.span_processor``, in a tree that has one), every 200 ms at least."""
    provider = TracerProvider()
    try:
        from serving.gateway.config import span_processor
    except ImportError:  # a checkout from before it (--gateway-root): the SDK's batches
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=200, max_queue_size=1 << 16)
    else:
        processor = span_processor(exporter, schedule_delay_millis=200, max_queue_size=1 << 16)
    provider.add_span_processor(processor)
    return provider


def recording_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    """Every span kept in memory (the sequential part reads them back)."""
    exporter = InMemorySpanExporter()
    return _batched(exporter), exporter


class EncodingExporter(SpanExporter):
    """What the OTLP exporter does with a batch short of the network: encode it (OTLP protobuf), count it,
    let it go. The gateway process of the sweep exports through it, so it pays production's encoding CPU
    (on the BatchSpanProcessor's thread, beside the serving loop) and frees its spans as production does;
    an ``InMemorySpanExporter`` kept every span of the run, and the cyclic collector's passes over that
    growing heap stopped the serving loop for up to 80 ms (10 passes, 330 ms in 9 s at 256 streams)."""

    def __init__(self) -> None:
        self.spans = 0
        self.encoded_bytes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        self.encoded_bytes += len(encode_spans(spans).SerializeToString())
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _packages(modules: set[str]) -> str:
    """``{"a.b", "a.c", "d"}`` -> ``"3 (a: 2, d: 1)"``: how many modules, by top-level package."""
    tops: dict[str, int] = {}
    for m in modules:
        tops[m.split(".")[0]] = tops.get(m.split(".")[0], 0) + 1
    by = ", ".join(f"{k}: {v}" for k, v in sorted(tops.items(), key=lambda kv: -kv[1]))
    return f"{len(modules)} ({by})"


class GCPauses:
    """Every cyclic-GC pass of this process, by generation: how long each held the GIL (a stall of the serving
    loop: every stream's chunk that arrives meanwhile waits) and how many objects it freed. A gateway process
    prints the summary on stderr when it stops (``gc.callbacks``: one call before and one after each pass)."""

    def __init__(self) -> None:
        self.passes: dict[int, list[tuple[float, float, int]]] = {0: [], 1: [], 2: []}  # (end, ms, freed)
        self._t = 0.0
        self._modules = set(sys.modules)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            now = (
                time.perf_counter()
            )  # CLOCK_MONOTONIC on Linux: the bench's phase windows are on the same clock
            self.passes[info["generation"]].append((now, (now - self._t) * 1e3, info["collected"]))

    def summary(self) -> str:
        parts = []
        for gen, passes in self.passes.items():
            ms = [m for _, m, _ in passes]
            parts.append(
                f"gen{gen} {len(ms)} passes {sum(ms):.1f} ms (max {max(ms, default=0):.1f}, "
                f"{sum(m > 4 for m in ms)} over 4 ms, freed {sum(c for _, _, c in passes)})"
            )
        long = sorted((t, gen, m) for gen, passes in self.passes.items() for t, m, _ in passes if m > 2)
        parts.append(
            "passes over 2 ms at " + (", ".join(f"{t:.1f} (gen{g} {m:.1f} ms)" for t, g, m in long) or "-")
        )
        parts.append(
            f"then {len(gc.get_objects(2))} objects in gen2, {gc.get_freeze_count()} frozen, counts "
            f"{gc.get_count()}; modules imported "
            f"since serving began: {_packages(set(sys.modules) - self._modules)}"
        )
        return (
            f"gc of gateway pid {os.getpid()} ({os.environ.get('BENCH_GATEWAY_ROOT') or 'this tree'}): "
            + "; ".join(parts)
        )


def exporting_provider() -> tuple[TracerProvider, EncodingExporter]:
    """Every span encoded as OTLP and let go (the sweep)."""
    exporter = EncodingExporter()
    return _batched(exporter), exporter


def streaming_upstream(tokens: int, token_ms: float, prompt_tokens: int = 5) -> Any:
    """An engine stand-in that streams: ``tokens`` chat chunks ``token_ms`` apart, in vLLM 0.10.2+'s shape
    (role chunk with ``prompt_token_ids``, ``token_ids`` and logprobs per chunk when asked, usage when asked;
    ``/weight_info`` and ``/is_paused`` as vLLM in dev mode, so the gateway reads versions as for a full reload),
    on the same HTTP stack as the gateway (``httpshell``)."""
    from _shared import VLLM_DEV_GETS

    from httpshell import ServerOptions
    from serving.asgi import ShellServer, dumps

    interval = token_ms / 1e3
    prompt_ids = list(range(1, prompt_tokens + 1))  # what the gateway's span carries (and exports) per call
    ids = itertools.count(1)
    served: list[
        tuple[float, float]
    ] = []  # (monotonic start, seconds) of each streamed call, for /bench/stats

    class StreamingUpstream(ShellServer):
        async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            if scope["method"] == "GET" and scope["path"] == "/bench/stats":
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": dumps(served_since(served, scope))})
                return
            if scope["method"] == "GET":
                path = scope["path"].rstrip("/")
                found = path == "/v1/models" or path in VLLM_DEV_GETS
                body = dumps(
                    {"object": "list", "data": [{"id": "policy", "object": "model"}]}
                    if path == "/v1/models"
                    else VLLM_DEV_GETS[path]
                    if found
                    else {"error": {"message": "not found", "type": "NotFoundError", "code": 404}}
                )
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200 if found else 404,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
            raw, more = b"", True
            while more:
                m = await receive()
                raw += m.get("body", b"")
                more = m.get("more_body", False)
            req = json.loads(raw)
            t0 = time.monotonic()
            base = {
                "id": f"chatcmpl-bench-{next(ids)}",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": req.get("model"),
            }
            want_ids, lp = bool(req.get("return_token_ids")), bool(req.get("logprobs"))
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )

            async def event(obj: dict) -> None:
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + dumps(obj) + b"\n\n",
                        "more_body": True,
                    }
                )

            await event(
                {
                    **base,
                    **({"prompt_token_ids": prompt_ids} if want_ids else {}),
                    "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    ],
                }
            )
            for i in range(tokens):
                await asyncio.sleep(interval)
                last = i == tokens - 1
                ch = {
                    "index": 0,
                    "delta": {"content": f"t{i} "},
                    "finish_reason": "length" if last else None,
                    "logprobs": {
                        "content": [{"token": f"t{i} ", "logprob": -0.5, "bytes": [], "top_logprobs": []}]
                    }
                    if lp
                    else None,
                }
                if want_ids:
                    ch["token_ids"] = [100 + i]
                await event({**base, "choices": [ch]})
            if (req.get("stream_options") or {}).get("include_usage"):
                await event(
                    {
                        **base,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": tokens,
                            "total_tokens": prompt_tokens + tokens,
                        },
                    }
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            served.append((t0, time.monotonic() - t0))

    return StreamingUpstream(ServerOptions(max_connections=CONNECTIONS, name="bench-upstream"))


def served_since(served: list[tuple[float, float]], scope: dict) -> dict[str, float]:
    """``GET /bench/stats?since=T``: the upstream's own time per streamed call (request read to ``[DONE]``
    sent) for the calls it started at or after monotonic time T (a phase's measured window). Next to the
    client's latency it tells the gateway's hop apart from the upstream itself slowing down, which on a
    shared machine is where the gateway's CPU shows: its stand-in engine paces tokens on the same cores."""
    since = float(scope["query_string"].decode().partition("since=")[2] or 0)
    times = [s for t, s in served if t >= since]
    return {
        "calls": len(times),
        "p50_ms": percentile(times, 0.5) * 1e3,
        "p99_ms": percentile(times, 0.99) * 1e3,
    }


def _start_gateway(args: argparse.Namespace) -> tuple[Any, TracerProvider, EncodingExporter, Any, Any]:
    """Start the gateway of this tree, or of ``BENCH_GATEWAY_ROOT``'s checkout, as that checkout's ``tracerl
    gateway`` starts it: (server, provider, exporter, its ``Worker`` or None, its ``GCPauses`` or None)."""
    worker = pauses = None
    try:
        from serving.gateway.proxy import Gateway, GatewayConfig
    except ModuleNotFoundError:  # a checkout from before serving/ was split by job
        from serving.gateway import Gateway, GatewayConfig

    if os.environ.get("BENCH_GATEWAY_ROOT") and importlib.util.find_spec("serving.gateway.workers") is None:
        # a checkout from before --workers: one process, its own way
        provider, exporter = exporting_provider()
        try:
            config = GatewayConfig(upstreams=[args.upstream], max_connections=CONNECTIONS)
        except TypeError:  # older still: no connection cap
            config = GatewayConfig(upstreams=[args.upstream])
        server = Gateway(("127.0.0.1", 0), config, provider).start_background()
    else:  # run as `tracerl gateway --workers N` runs it (this tree's, or a checkout that has --workers)
        from serving.gateway.workers import fork_workers

        try:
            from serving.gateway.workers import tune_for_relaying
        except ImportError:  # a checkout from before it
            from serving.gateway.workers import calm_gc as tune_for_relaying

        worker = fork_workers(args.workers, "127.0.0.1", 0)
        provider, exporter = exporting_provider()  # after the fork: each process exports its own
        canary = getattr(args, "canary", 0.0)
        arms = {"policy@5": args.upstream, "policy@6": args.upstream} if canary else {}
        config = GatewayConfig(
            upstreams=[args.upstream],
            max_connections=CONNECTIONS,
            reuse_port=args.workers > 1,
            canary=canary or None,
            upstream_for=arms,
        )
        server = Gateway(("127.0.0.1", worker.port), config, provider).start_background()
        tune_for_relaying()
        pauses = GCPauses()
        gc.callbacks.append(pauses)
    return server, provider, exporter, worker, pauses


def serve_process(args: argparse.Namespace) -> int:
    """``gateway_rig.py upstream|gateway``: one server in this process (``--workers`` gateway processes, as
    ``tracerl gateway --workers`` runs them); prints its URL, runs until SIGTERM, and (gateway) each
    process prints how many spans it recorded."""
    if args.serve == "upstream":
        server = streaming_upstream(args.tokens, args.token_ms, args.prompt_tokens).start_background()
        provider = exporter = worker = pauses = None
    else:
        server, provider, exporter, worker, pauses = _start_gateway(args)
    # wait as `tracerl gateway` waits (tracerl/signals.py): on an event, not by polling, whose wake-ups every
    # 50 ms took the GIL from the serving thread and were counted as the gateway's CPU (py-spy: 10 % of its
    # samples at one stream; 6 % of them at 256 streams were the loop waiting for the GIL, this thread's or
    # the exporter's)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if worker is not None:
        worker.serving()
    if worker is None or worker.parent:
        print(server.url, flush=True)
    stop.wait()
    try:
        server.stop()
        if provider is not None:
            provider.force_flush()
            print(exporter.spans, flush=True)
            if pauses is not None:
                print(pauses.summary(), file=sys.stderr, flush=True)
            provider.shutdown()
    finally:
        if worker is not None:
            worker.finish()
    return 0


def start_server(
    role: str, args: argparse.Namespace, upstream: str = "", root: str = "", canary: float = 0.0
) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        role,
        "--tokens",
        str(args.tokens),
        "--token-ms",
        str(args.token_ms),
        "--prompt-tokens",
        str(getattr(args, "prompt_tokens", 5)),
        "--upstream",
        upstream,
        "--canary",
        str(canary),
        "--workers",
        str(1 if root or canary or role == "upstream" else args.workers),
    ]
    env = dict(os.environ)
    if root:
        env["BENCH_GATEWAY_ROOT"] = str(Path(root).resolve())
        env["PYTHONPATH"] = env["BENCH_GATEWAY_ROOT"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    return proc, proc.stdout.readline().strip()


def stop_server(proc: subprocess.Popen) -> list[int]:
    """Stop a server process; the span counts its processes printed (none for the upstream)."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return [int(line) for line in out.split() if line.isdigit()]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process and its children (--workers), from /proc/PID/stat fields 14
    and 15 (clock ticks) and /proc/PID/task/PID/children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        children = []
    return own + sum(cpu_seconds(c) for c in children)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("serve", choices=["upstream", "gateway"], help="which server this process runs")
    ap.add_argument("--tokens", type=int, default=16, help="upstream: chunks per stream")
    ap.add_argument("--token-ms", type=float, default=25.0, help="upstream: ms between chunks")
    ap.add_argument("--prompt-tokens", type=int, default=5, help="upstream: prompt token ids it returns")
    ap.add_argument("--upstream", default="", help="gateway: the upstream's URL")
    ap.add_argument("--canary", type=float, default=0.0, help="gateway: route this canary share (0: none)")
    ap.add_argument("--workers", type=int, default=1, help="gateway: processes on one port")
    return serve_process(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
