"""What the tracerl gateway costs: added latency per call, and a concurrency sweep of streaming calls.

Both parts run the same clients against the upstream directly and through the gateway in one run, so
machine noise hits both paths alike; the gateway records spans exactly as in production, through a
BatchSpanProcessor (the sequential part exports to memory; the sweep's gateway process encodes each batch as
the OTLP exporter does and drops it, ``gateway_rig.EncodingExporter``: no collector is needed).

1. Sequential latency (``run``): non-streamed calls, interleaved call by call, through the gateway vs
   direct, to a scripted upstream that answers at once in vLLM's shape (``_shared.ScriptedUpstream``),
   or with ``--model DIR`` to the embedded server (``max_tokens=1``). Target: <= 1 ms p50 added.
2. Concurrency sweep (``sweep``): N streaming clients (default 1, 64, 256, 1024) each send calls back
   to back for ``--seconds``, first direct, then through the gateway. The upstream streams like an
   engine: ``--tokens`` chunks, ``--token-ms`` apart (vLLM's chunk shape, token ids, logprobs). The
   upstream and the gateway each run in their own process (``gateway_rig.py``; as in production, the
   gateway does not share a GIL with the engine or the agents); the clients are one asyncio process
   speaking raw HTTP/1.1, so the client side costs little. Per N: completed calls/s, p50/p99 latency of
   a whole stream, errors, and the gateway's additions. Targets: p50 added <= 1 ms at 1 client; p99
   added <= 5 ms and throughput >= 0.9x direct at 256; no errors at 1024.
   Under each table, where the added p50 is: the upstream's own time per call in each phase (``up``,
   from its ``/bench/stats``) and the rest (``hop``, the client's p50 minus the upstream's). The
   stand-in paces its tokens on the same cores, so CPU the gateway takes from it shows as ``+up``;
   ``+hop`` is what the path through the gateway adds itself. Then the same comparison interleaved: each
   client alternates its calls between the upstream and the gateway, so both paths see the same moment's
   load (on a shared machine the phases, one after the other, do not; this figure leaves out what the
   gateway's CPU costs the machine, which the phases show).

Reading it on a shared machine: a gateway process is one event-loop thread, so when the cores are
oversubscribed the scheduler gives it about cores/load of one core (``gw %``), whatever it needs; a
thread-per-connection server (``--gateway-root`` of an older checkout) gets a share per thread.
``--workers N`` runs N gateway processes on one port, as ``tracerl gateway --workers N`` does. The
CPU ms per call (``gw cpu``, all gateway processes together) is the figure that does not depend on
the neighbours. At 1 client it is mostly wake-ups, not work: each chunk wakes an idle process, and on
this VM an idle event loop pays 100-150 us of CPU per wake 25 ms apart against under 1 us back to
back (``wake_cpu_us``, printed under the sweep), so a 16-chunk call costs the gateway 5-9 ms there
against about 1 ms at 256 clients, and the upstream stand-in, which does almost nothing per chunk,
shows a like ratio (3-5 ms against 0.4).

3. Canary routing (``--canary FRACTION`` with the sweep): a third path, a gateway routing by
   ``--canary`` (both arms on the same upstream, so only the routing differs); each client is one
   rollout (a fixed ``traceparent``), as an agent's calls are. Measured three ways at each client count:
   as a phase after the plain gateway's (as the sweep measures every path); interleaved across the two
   gateway processes (``interleaved``: each client alternates its calls between the plain and the canary
   gateway, so both see the same moment's load); and in one process (each client alternates between a
   model the canary gateway routes and one it does not route, which it proxies plainly: the routing is the
   only difference, and the scheduler's noise between two processes is gone; on a shared machine this is
   the figure to read). Target: the routing adds <= 0.5 ms p50 over plain proxying at 64 clients.

    python bench/gateway.py --calls 2000                  # sequential latency only
    python bench/gateway.py --sweep 1 64 256 1024         # sweep only
    python bench/gateway.py --calls 0 --workers 2         # sweep, two gateway processes
    python bench/gateway.py --calls 0 --sweep 64 --canary 0.2   # canary routing vs plain, 64 streams
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _shared import percentile
from gateway_report import print_sweep
from gateway_rig import (  # the upstream and gateway processes (tests use them from here)
    cpu_seconds,
    recording_provider,
    start_server,
    stop_server,
    streaming_upstream,
)

__all__ = ["cpu_seconds", "recording_provider", "start_server", "stop_server", "streaming_upstream"]


# -- 1. sequential latency ------------------------------------------------------------------------------


def run(calls: int, model_dir: str | None) -> dict[str, float]:
    from _shared import ScriptedUpstream
    from scripted_server import Server  # (tests/, put on the path by _shared)

    from serving.gateway.proxy import Gateway, GatewayConfig

    if model_dir:
        from serving.embedded.server import EmbeddedServer

        upstream: Any = EmbeddedServer.start(model_dir)
    else:
        upstream = Server(
            ("127.0.0.1", 0), type("Ok", (ScriptedUpstream,), {"answer": "ok"})
        ).start_background()
    provider, exporter = recording_provider()
    gateway = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[upstream.url]), provider).start_background()
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    direct_t, gw_t = [], []
    with httpx.Client(timeout=30) as client:
        for i in range(calls + 50):
            for base, out in (
                ((upstream.url, direct_t), (gateway.url, gw_t))
                if i % 2
                else ((gateway.url, gw_t), (upstream.url, direct_t))
            ):
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
    return {
        "calls": calls,
        "spans": spans,
        "direct_p50_ms": d50,
        "direct_p99_ms": d99,
        "gateway_p50_ms": g50,
        "gateway_p99_ms": g99,
        "added_p50_ms": g50 - d50,
        "added_p99_ms": g99 - d99,
        "ratio_p50": g50 / d50,
    }


# -- 2. the concurrency sweep ---------------------------------------------------------------------------


def wake_cpu_us(interval_s: float, wakes: int) -> float:
    """CPU microseconds a bare event loop (uvloop, as the servers run) spends per wake-up ``interval_s`` apart:
    what an idle process pays per chunk whatever it does with it (the 1-client ``gw cpu``)."""
    try:
        import uvloop

        run_loop: Any = uvloop.run
    except ImportError:
        run_loop = asyncio.run

    async def sleeper() -> float:
        t = time.process_time()
        for _ in range(wakes):
            await asyncio.sleep(interval_s)
        return (time.process_time() - t) / wakes * 1e6

    return run_loop(sleeper())


class Phase:
    """One sweep step: N clients on one path. (A plain class: tests load this file without a module entry,
    which dataclasses need.)"""

    def __init__(self, clients: int, seconds: float):
        self.clients, self.seconds = clients, seconds
        self.latencies: list[float] = []  # of the calls started after the warm-up
        self.errors: list[str] = []
        self.cpu: list[float] = []  # CPU seconds of each server process in the phase
        self.calls = 0  # completed calls, warm-up included (what the CPU seconds paid for)
        self.wall = 0.0  # seconds the phase took, warm-up and draining included
        self.client_cpu = 0.0  # CPU seconds of the clients (this process) in the phase
        self.upstream: dict[str, float] = {}  # the upstream's own p50_ms / p99_ms per call (/bench/stats)

    @property
    def per_s(self) -> float:
        return len(self.latencies) / self.seconds

    def p(self, q: float) -> float:
        return percentile(self.latencies, q) * 1e3


async def stream_call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
    """One streamed call over a kept-alive connection: send, then read the chunked SSE answer to its end."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        body += (await reader.readexactly(size + 2))[:-2]
        if size == 0:
            break
    if not body.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"stream ended without [DONE]: {bytes(body[-80:])!r}")


def stream_request(url: str, model: str = "policy") -> tuple[str, int, bytes]:
    """(host, port, the bytes of one streaming chat call) for ``url``; each client's calls share a trace id
    (one rollout), so the canary gateway routes them by it (a ``model`` other than ``policy`` it does not
    route: plain proxying in the same process)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Say something."}],
        }
    ).encode()
    tp = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01".encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"traceparent: %s\r\nContent-Length: %d\r\n\r\n%s"
        % (f"{host}:{port}".encode(), tp, len(payload), payload)
    )
    return host, int(port), request


async def client_loop(url: str, phase: Phase, start: float, end: float) -> None:
    host, port, request = stream_request(url)
    reader = writer = None
    while time.perf_counter() < end:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
            t = time.perf_counter()
            await stream_call(reader, writer, request)
            phase.calls += 1
            if t >= start:
                phase.latencies.append(time.perf_counter() - t)
        except Exception as e:  # counted; the connection is reopened
            phase.errors.append(f"{type(e).__name__}: {e}"[:200])
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.05)
    if writer is not None:
        writer.close()


async def run_phase(url: str, clients: int, seconds: float, warm_s: float) -> Phase:
    phase = Phase(clients, seconds)
    t0 = time.perf_counter()
    start, end = t0 + warm_s, t0 + warm_s + seconds
    await asyncio.gather(*(client_loop(url, phase, start, end) for _ in range(clients)))
    return phase


def measured(url: str, n: int, args: argparse.Namespace, procs: list[subprocess.Popen], up_url: str) -> Phase:
    """One phase, with the CPU seconds each server process and the clients spent during it (warm-up
    included), and the upstream's own time per call in its measured window (``/bench/stats``)."""
    warm = max(0.5, 2 * (args.tokens * args.token_ms / 1e3))
    before, t0, c0 = [cpu_seconds(p.pid) for p in procs], time.perf_counter(), time.process_time()
    since = time.monotonic() + warm
    phase = asyncio.run(run_phase(url, n, args.seconds, warm))
    phase.cpu = [cpu_seconds(p.pid) - b for p, b in zip(procs, before, strict=True)]
    phase.client_cpu = time.process_time() - c0
    phase.wall = time.perf_counter() - t0
    phase.upstream = httpx.get(f"{up_url}/bench/stats?since={since}", timeout=30).json()
    window(f"{url} phase", n, since, since + args.seconds)
    return phase


def window(what: str, clients: int, start: float, end: float) -> None:
    """Say on stderr when a measured window ran (CLOCK_MONOTONIC, as the gateway's GC log): a pass inside one
    stalled its streams."""
    print(f"measured {what}, {clients} clients: {start:.1f}-{end:.1f}", file=sys.stderr, flush=True)


async def alternate(
    urls: list[str],
    phases: list[Phase],
    start: float,
    end: float,
    models: tuple[str, ...] = ("policy", "policy"),
) -> None:
    """One client: calls to each url (asking for the model at the same place in ``models``) in turn, each on
    its own kept-alive connection."""
    conns: list[Any] = [None] * len(urls)
    reqs = [stream_request(u, m) for u, m in zip(urls, models, strict=True)]
    i = 0
    while time.perf_counter() < end:
        k, i = i % len(urls), i + 1
        host, port, request = reqs[k]
        try:
            if conns[k] is None:
                conns[k] = await asyncio.open_connection(host, port, limit=1 << 20)
            t = time.perf_counter()
            await stream_call(*conns[k], request)
            phases[k].calls += 1
            if t >= start:
                phases[k].latencies.append(time.perf_counter() - t)
        except Exception as e:  # counted; the connection is reopened
            phases[k].errors.append(f"{type(e).__name__}: {e}"[:200])
            if conns[k] is not None:
                conns[k][1].close()
            conns[k] = None
            await asyncio.sleep(0.05)
    for c in conns:
        if c is not None:
            c[1].close()


def interleaved(
    plain: str,
    canary: str,
    clients: int,
    args: argparse.Namespace,
    models: tuple[str, str] = ("policy", "policy"),
) -> tuple[Phase, Phase]:
    """``clients`` streams, each alternating its calls between two URLs (the same moments' load on both):
    the plain and the canary gateway, or the upstream itself and the gateway; or, with ``models``, between
    a model the canary gateway does not route and one it routes, in one gateway process."""
    phases = [Phase(clients, args.seconds), Phase(clients, args.seconds)]
    warm = max(0.5, 2 * (args.tokens * args.token_ms / 1e3))

    async def run_all() -> None:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                alternate(
                    [plain, canary] if c % 2 else [canary, plain],
                    phases if c % 2 else phases[::-1],
                    t0 + warm,
                    t0 + warm + args.seconds,
                    models if c % 2 else models[::-1],
                )
                for c in range(clients)
            )
        )

    t = time.perf_counter()
    asyncio.run(run_all())
    window(f"{plain} vs {canary} interleaved", clients, t + warm, t + warm + args.seconds)
    return phases[0], phases[1]


def sweep(levels: list[int], args: argparse.Namespace) -> list[dict]:
    """Direct, then through the gateway (then through --gateway-root's), at each client count."""
    up, up_url = start_server("upstream", args)
    gateways = {"gateway": start_server("gateway", args, up_url)}
    if args.gateway_root:
        gateways["other"] = start_server("gateway", args, up_url, args.gateway_root)
    canary = getattr(args, "canary", 0.0)  # a Namespace built by hand (tests) may lack it
    if canary:
        gateways["canary"] = start_server("gateway", args, up_url, canary=canary)
    rows = []
    try:
        for n in levels:
            row: dict[str, Any] = {"clients": n, "direct": measured(up_url, n, args, [up], up_url)}
            for name, (proc, url) in gateways.items():
                row[name] = measured(url, n, args, [up, proc], up_url)
            if canary:
                row["ab"] = interleaved(gateways["gateway"][1], gateways["canary"][1], n, args)
                url = gateways["canary"][1]  # routed and plain calls in the one canary gateway process
                row["ab_one"] = interleaved(url, url, n, args, models=("unrouted", "policy"))
            row["ab_direct"] = interleaved(up_url, gateways["gateway"][1], n, args)
            if args.gateway_root:
                row["ab_other"] = interleaved(gateways["other"][1], gateways["gateway"][1], n, args)
            row["load"] = os.getloadavg()[0]
            rows.append(row)
    finally:
        spans = {name: sum(stop_server(proc)) for name, (proc, _) in gateways.items()}
        stop_server(up)
    for r in rows:
        r["spans"] = spans
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--calls", type=int, default=1000, help="sequential calls per path (0: skip; default: %(default)s)"
    )
    ap.add_argument(
        "--model", default=None, help="sequential part: use the embedded server on this model dir"
    )
    ap.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=[1, 64, 256, 1024],
        help="concurrent streaming clients per step (none: skip; default: %(default)s)",
    )
    ap.add_argument(
        "--seconds", type=float, default=5.0, help="measured seconds per sweep phase (default: %(default)s)"
    )
    ap.add_argument(
        "--tokens", type=int, default=16, help="chunks per scripted stream (default: %(default)s)"
    )
    ap.add_argument("--token-ms", type=float, default=25.0, help="ms between chunks (default: %(default)s)")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=5,
        help="prompt token ids the scripted upstream returns, so each span carries (and the gateway exports) "
        "that many; agents' prompts run to thousands (default: %(default)s)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="sweep: gateway processes on one port, as `tracerl gateway --workers` (default: %(default)s)",
    )
    ap.add_argument(
        "--gateway-root",
        default="",
        metavar="DIR",
        help="sweep: run the gateway of another checkout (e.g. the last release) in the same run",
    )
    ap.add_argument(
        "--canary",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="sweep: also a gateway routing this canary share, to measure the routing (0: skip)",
    )
    args = ap.parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    if args.calls:
        r = run(args.calls, args.model)
        print(f"calls per path: {r['calls']} (+50 warm-up)  gateway spans recorded: {r['spans']}")
        print(f"direct : p50 {r['direct_p50_ms']:.3f} ms   p99 {r['direct_p99_ms']:.3f} ms")
        print(f"gateway: p50 {r['gateway_p50_ms']:.3f} ms   p99 {r['gateway_p99_ms']:.3f} ms")
        print(
            f"added  : p50 {r['added_p50_ms']:.3f} ms   p99 {r['added_p99_ms']:.3f} ms   "
            f"ratio p50 {r['ratio_p50']:.2f}x   (target: <= 1 ms p50 added)"
        )
    if args.sweep:
        print_sweep(sweep(args.sweep, args), args)
        print(
            f"a bare event loop here: {wake_cpu_us(args.token_ms / 1e3, 40):.0f} us CPU per wake-up "
            f"{args.token_ms:g} ms apart, {wake_cpu_us(0, 2000):.1f} us back to back (the 1-client gw cpu "
            "is mostly such wake-ups: two or more per chunk)"
        )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
