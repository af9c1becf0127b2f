"""How ``bench/gateway.py`` prints a concurrency sweep: each path against direct calls, where the added
latency is, the interleaved comparisons, and the canary's routing against plain proxying."""

from __future__ import annotations

import argparse
import os
import time


def routing_cost_us(calls: int = 100_000) -> float:
    """CPU microseconds per call of the canary's routing decision (``Gateway.canary_arm``: headers to
    arm), the only work a canary adds to a call: a floor for the routing's added latency that load on
    the machine does not blur."""
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.datastructures import Headers

    from serving.gateway.proxy import Gateway, GatewayConfig

    arms = {"policy@5": "http://127.0.0.1:1", "policy@6": "http://127.0.0.1:2"}
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(canary=0.2, upstream_for=arms), TracerProvider())
    headers = Headers(
        {
            "traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01",
            "content-type": "application/json",
        }
    )
    t = time.process_time()
    for _ in range(calls):
        gw.canary_arm("policy", headers)
    return (time.process_time() - t) / calls * 1e6


def print_interleaved(rows: list[dict], key: str = "ab_direct", base: str = "the upstream") -> None:
    """This gateway's added latency over ``base`` with both paths at the same moments: over direct calls
    (``row["ab_direct"]``), or over the gateway of ``--gateway-root`` (``row["ab_other"]``: an A/B of two
    gateways, which phases one after the other blur on a shared machine)."""
    print(
        f"\n{base} vs this gateway, interleaved (each client alternates its calls between {base} and this "
        "gateway, so both see the same moment's load; the phases above run one after the other)"
    )
    for r in rows:
        d, g = r[key]
        print(
            f"{r['clients']:>7} clients: {'direct' if key == 'ab_direct' else 'base'} p50 {d.p(0.5):.2f} p99 {d.p(0.99):.2f} ms ({len(d.latencies)} calls, "
            f"{len(d.errors)} err), gateway p50 {g.p(0.5):.2f} p99 {g.p(0.99):.2f} ms ({len(g.latencies)} calls, "
            f"{len(g.errors)} err): +p50 {g.p(0.5) - d.p(0.5):+.2f} ms, +p99 {g.p(0.99) - d.p(0.99):+.2f} ms "
            f"| load1 {r['load']:.1f}"
        )


def print_split(rows: list[dict], name: str) -> None:
    """Where the added latency is: the upstream's own time per call (``/bench/stats``) in each phase, and
    the rest (``hop``: the client's p50 minus the upstream's, what the path in between adds)."""
    print(
        "  where the added p50 is: up = the upstream's own time per call (request to [DONE]); hop = client p50 "
        "- up p50; cl cpu: the clients' CPU ms per call"
    )
    print(
        f"  {'clients':>7} | {'up direct':>9} {'up via':>8} {'+up':>7} | {'hop direct':>10} {'hop via':>8} "
        f"{'+hop':>7} | {'up p99 d/v':>15} | {'cl cpu d/v':>11} | load1"
    )
    for r in rows:
        d, g = r["direct"], r[name]
        ud, ug = d.upstream.get("p50_ms", float("nan")), g.upstream.get("p50_ms", float("nan"))
        hd, hg = d.p(0.5) - ud, g.p(0.5) - ug
        print(
            f"  {r['clients']:>7} | {ud:>9.2f} {ug:>8.2f} {ug - ud:>7.2f} | {hd:>10.2f} {hg:>8.2f} {hg - hd:>7.2f} | "
            f"{d.upstream.get('p99_ms', float('nan')):>7.1f}/{g.upstream.get('p99_ms', float('nan')):<7.1f} | "
            f"{d.client_cpu / max(1, d.calls) * 1e3:>5.2f}/{g.client_cpu / max(1, g.calls) * 1e3:<5.2f} | "
            f"{r['load']:.1f}"
        )


def print_canary(rows: list[dict]) -> None:
    """Canary routing against plain proxying: as phases, interleaved across two gateway processes, and
    interleaved in one process (the figure that the scheduler's noise between processes does not blur)."""
    print("\ncanary routing vs plain proxying, same run (+p50: canary gateway p50 - plain gateway p50)")
    for r in rows:
        g, c = r["gateway"], r["canary"]
        print(
            f"{r['clients']:>7} clients: plain p50 {g.p(0.5):.2f} ms, canary p50 {c.p(0.5):.2f} ms, "
            f"+p50 {c.p(0.5) - g.p(0.5):+.2f} ms (target <= 0.5 ms at 64); "
            f"gw cpu per call {g.cpu[1] / max(1, g.calls) * 1e3:.2f} vs {c.cpu[1] / max(1, c.calls) * 1e3:.2f} ms"
        )
    print(f"routing decision: {routing_cost_us():.1f} us CPU per call (Gateway.canary_arm, in process)")
    print("interleaved (each client alternates its calls between the two gateways; the same moments' load)")
    for r in rows:
        g, c = r["ab"]
        print(
            f"{r['clients']:>7} clients: plain p50 {g.p(0.5):.2f} ms ({len(g.latencies)} calls, "
            f"{len(g.errors)} err), canary p50 {c.p(0.5):.2f} ms ({len(c.latencies)} calls, {len(c.errors)} err), "
            f"+p50 {c.p(0.5) - g.p(0.5):+.2f} ms (target <= 0.5 ms at 64)"
        )
    print(
        "in one process (each client alternates its calls between a model the canary gateway routes and one it "
        "does not, which it proxies plainly: the routing is the only difference, at the same moments)"
    )
    for r in rows:
        g, c = r["ab_one"]
        print(
            f"{r['clients']:>7} clients: plain p50 {g.p(0.5):.2f} ms ({len(g.latencies)} calls, "
            f"{len(g.errors)} err), routed p50 {c.p(0.5):.2f} ms ({len(c.latencies)} calls, {len(c.errors)} err), "
            f"+p50 {c.p(0.5) - g.p(0.5):+.2f} ms (target <= 0.5 ms at 64) | load1 {r['load']:.1f}"
        )


def print_sweep(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nconcurrency sweep: streaming calls of {args.tokens} chunks {args.token_ms:g} ms apart "
        f"(~{args.tokens * args.token_ms:g} ms each), {getattr(args, 'prompt_tokens', 5)} prompt token ids, "
        f"{args.seconds:g} s per phase; gateway spans exported: {rows[0]['spans'] if rows else {}}"
    )
    names = [k for k in ("gateway", "other", "canary") if rows and k in rows[0]]
    for name in names:
        procs = f" ({args.workers} processes)" if args.workers > 1 else ""
        label = (
            f"this gateway{procs}"
            if name == "gateway"
            else f"gateway of {args.gateway_root}"
            if name == "other"
            else f"this gateway routing a canary share of {args.canary:g} (1 process)"
        )
        print(
            f"\n{label} vs direct (gw cpu / up cpu: CPU ms per call of the gateway / upstream process; "
            f"gw %: the gateway process's share of one core during the phase)"
        )
        print(
            f"{'clients':>7} | {'direct/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'err':>4} | {'via/s':>8} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'err':>4} | {'+p50 ms':>8} {'+p99 ms':>8} {'thru x':>6} | {'gw cpu':>6} "
            f"{'up cpu':>6} {'gw %':>5} | load1"
        )
        for r in rows:
            d, g = r["direct"], r[name]
            ratio = g.per_s / d.per_s if d.per_s else float("nan")
            calls = max(1, g.calls)
            print(
                f"{r['clients']:>7} | {d.per_s:>8.1f} {d.p(0.5):>8.2f} {d.p(0.99):>8.2f} {len(d.errors):>4} | "
                f"{g.per_s:>8.1f} {g.p(0.5):>8.2f} {g.p(0.99):>8.2f} {len(g.errors):>4} | "
                f"{g.p(0.5) - d.p(0.5):>8.2f} {g.p(0.99) - d.p(0.99):>8.2f} {ratio:>6.2f} | "
                f"{g.cpu[1] / calls * 1e3:>6.2f} {d.cpu[0] / max(1, d.calls) * 1e3:>6.2f} "
                f"{100 * g.cpu[1] / g.wall:>5.0f} | {r['load']:.1f}"
            )
            for e in sorted(set(d.errors + g.errors))[:3]:
                print(f"        error: {e}")
        print_split(rows, name)
    if rows and "ab_direct" in rows[0]:
        print_interleaved(rows)
    if rows and "ab_other" in rows[0]:
        print_interleaved(rows, "ab_other", f"the gateway of {args.gateway_root}")
    if "canary" in names:
        print_canary(rows)
    print(
        "targets: added p50 <= 1 ms at 1 client; added p99 <= 5 ms and throughput >= 0.9x at 256; "
        "no errors at 1024"
    )
