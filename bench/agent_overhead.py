"""Instrumentation overhead per LLM call: the same agent plain vs. under `opentelemetry-instrument`.

The agent (``bench/_overhead_agent.py``: plain `openai` client, a writer and a rewriter taking
turns, each call timed around ``client.chat.completions.create``) runs as a user runs it:

    plain         python _overhead_agent.py
    instrumented  opentelemetry-instrument python _overhead_agent.py   (OpenLLMetry openai
                  instrumentation, OTEL_TRACES_EXPORTER=otlp to a real `tracerl collect`)

Both variants call the same real `tracerl gateway` (exporting its own spans to the same `tracerl
collect`; the two started as ``tracerl demo`` starts them, by ``tracerl/stack.py``) in front of the
same upstream, with the same environment; only the command differs. The two alternate process by process over --reps repetitions (ABBA order)
so machine drift hits both alike. Two upstreams:

  tiny      the embedded CPU engine on the tiny model, generating --max-tokens tokens per call:
            the relative cost (target: <= 2 % added per call)
  scripted  a fixed-answer server that answers at once: the absolute cost in µs per call,
            with no model time to hide it

Per call: p50 / mean / p90 latency of each variant, and the added µs and %, over all calls but
each process's first (connection setup, lazy imports), pooled; "paired" is the median over
repetitions of (instrumented p50 - plain p50) within one repetition, with its range: the noise
to read the added figures against. CPU/call is the agent process's CPU time per call (all
threads, so the span exporter's too): steadier than wall time when other processes share the
cores. Per process: wall time minus the calls, i.e. interpreter startup plus exit; its
difference is what `opentelemetry-instrument` costs once per process (instrumentation loading,
SDK setup, the final span flush). The store is checked: every instrumented call must have
arrived as an `openai.chat` span carrying its response id, with the gateway's span as its child.
The 2 % target is judged by the larger of the direct tiny-engine figure and the scripted
upstream's added µs over the tiny engine's p50 (see ``verdict``).

Writes only under --out, by default bench/out/agent_overhead/ (the tiny model, built once, the span
store, replaced each run, and the collector's and gateway's logs in logs/; query the store with
`tracerl sql --store bench/out/agent_overhead/store`).

    python bench/agent_overhead.py                     # both upstreams, ~60-90 s on 2 cores
    python bench/agent_overhead.py --upstream tiny --calls 100 --reps 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
AGENT = HERE / "_overhead_agent.py"
OUT = HERE / "out" / "agent_overhead"
sys.path.insert(0, str(ROOT))

from store.location import parse_store  # noqa: E402
from tracerl.stack import StackConfig, running_stack  # noqa: E402

sys.path.insert(0, str(HERE))
from _shared import ScriptedUpstream, percentile  # noqa: E402
from scripted_server import Server  # noqa: E402 (tests/, put on the path by _shared)

VARIANTS = ("plain", "instrumented")


@dataclass
class Run:
    """One agent process: its calls' latencies (s), response ids, loop CPU time (s) and wall time (s)."""

    variant: str
    latencies: list[float]
    ids: list[str]
    loop_cpu: float
    wall: float

    @property
    def fixed(self) -> float:
        """Startup + exit: the process's wall time not spent inside a call."""
        return self.wall - sum(self.latencies)


@dataclass
class Result:
    """Every timed run against one upstream, and what the store holds of them."""

    upstream: str
    runs: list[Run] = field(default_factory=list)
    calls_total: int = 0  # warm-up runs included: each went through the gateway
    spans_found: int = 0  # instrumented timed calls whose response id is on an `openai.chat` span
    joined: int = 0  # ... whose gateway span is that span's child (W3C traceparent)
    gateway_spans: int = 0

    def of(self, variant: str) -> list[Run]:
        return [r for r in self.runs if r.variant == variant]

    def steady(self, variant: str) -> list[float]:
        return [x for r in self.of(variant) for x in r.latencies[1:]]

    def instrumented_ids(self) -> set[str]:
        return {i for r in self.of("instrumented") for i in r.ids}


def agent_env(gateway_url: str, otlp: str, service: str, export_every_ms: int) -> dict[str, str]:
    """One environment for both variants (plain python ignores the OTEL_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(
        {
            "OPENAI_BASE_URL": f"{gateway_url}/v1",
            "OPENAI_API_KEY": "sk-local",
            "OTEL_SERVICE_NAME": service,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": str(export_every_ms),
        }
    )
    return env


def run_agent(variant: str, calls: int, max_tokens: int, env: dict[str, str]) -> Run:
    cmd = [sys.executable, str(AGENT), str(calls), str(max_tokens)]
    if variant == "instrumented":
        cmd = [str(BIN / "opentelemetry-instrument"), *cmd]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} agent exited {proc.returncode}:\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Run(variant, out["latencies_s"], out["response_ids"], out["loop_cpu_s"], wall)


def bench_upstream(name: str, upstream: Server, store: Path, args: argparse.Namespace) -> Result:
    """`tracerl collect` and `tracerl gateway` in front of ``upstream`` (``tracerl/stack.py``); warm up both
    variants once (untimed: page cache, engine), then --reps ABBA-ordered pairs of agent processes. Leaving the
    stack stops the gateway first (it flushes its spans), then the collector (it drains its WAL into Parquet)."""
    cfg = StackConfig(store=str(store), logs=Path(args.out) / "logs", server=upstream.url)
    res = Result(name)
    with running_stack(cfg) as stack:
        env = agent_env(stack.urls.gateway, stack.urls.otlp, f"overhead-agent-{name}", args.export_every_ms)
        warm = [run_agent(v, args.warmup_calls, args.max_tokens, env) for v in VARIANTS if args.warmup_calls]
        for rep in range(args.reps):
            for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                res.runs.append(run_agent(variant, args.calls, args.max_tokens, env))
                print(
                    f"  {name}: rep {rep + 1}/{args.reps} {variant:<12} "
                    f"p50 {statistics.median(res.runs[-1].latencies[1:]) * 1e3:.2f} ms",
                    file=sys.stderr,
                )
    res.calls_total = sum(len(r.latencies) for r in warm + res.runs)
    return res


def count_spans(store: Path, results: list[Result]) -> None:
    """Fill in, per upstream, what of its calls arrived in the store (see ``Result``)."""
    from store.views import connect_readonly

    con = connect_readonly(parse_store(store))
    for r in results:
        svc = f"overhead-agent-{r.upstream}"
        agent = con.execute(
            """SELECT attributes['gen_ai.response.id'] FROM spans
            WHERE name = 'openai.chat' AND resource_attributes['service.name'] = ?""",
            [svc],
        ).fetchall()
        joined = con.execute(
            """SELECT a.attributes['gen_ai.response.id'] FROM spans g JOIN spans a
            ON g.trace_id = a.trace_id AND g.parent_span_id = a.span_id
            WHERE g.name = 'tracerl.gateway policy' AND a.name = 'openai.chat'
              AND a.resource_attributes['service.name'] = ?""",
            [svc],
        ).fetchall()
        ids = r.instrumented_ids()
        r.spans_found = len(ids & {row[0] for row in agent})
        r.joined = len(ids & {row[0] for row in joined})
    total = con.execute("SELECT count(*) FROM spans WHERE name = 'tracerl.gateway policy'").fetchone()[0]
    results[
        0
    ].gateway_spans = total  # one gateway for each upstream, one store: the total is what is checkable


def tiny_upstream(args: argparse.Namespace) -> Server:
    """The embedded engine on the tiny model (built once under --out), torch on --engine-threads."""
    import torch

    from serving.embedded.server import EmbeddedServer
    from serving.models.tiny_model import build_tiny_model

    torch.set_num_threads(args.engine_threads)
    model = Path(args.model) if args.model else Path(args.out) / "tiny-model"
    if not args.model and not (model / "config.json").exists():
        build_tiny_model(model, seed=0)
    return EmbeddedServer.start(str(model))


def report(results: list[Result], args: argparse.Namespace) -> str:
    """The printed table: per variant, then what instrumentation adds, then the span check and target."""
    lines = [
        f"{args.calls} calls per agent process (the first is warm-up, not timed), {args.reps} processes per "
        f"variant and upstream (ABBA), tiny model generating {args.max_tokens} tokens per call, "
        f"instrumented agent exporting every {args.export_every_ms} ms",
        "",
        f"{'upstream':<9} {'variant':<13} {'calls':>5} {'p50 ms':>8} {'mean ms':>8} {'p90 ms':>8} "
        f"{'CPU µs/call':>11} {'process ms':>10}",
    ]
    added = []
    for r in results:
        row = {v: _figures(r, v) for v in VARIANTS}
        lines += [_variant_line(r, v, row[v]) for v in VARIANTS]
        pairs = [
            statistics.median(b.latencies[1:]) - statistics.median(a.latencies[1:])
            for a, b in zip(r.of("plain"), r.of("instrumented"))
        ]
        added.append((r, row["plain"], row["instrumented"], pairs))
    lines += [
        "",
        "added by instrumentation (instrumented - plain):",
        f"{'upstream':<9} {'p50':>16} {'mean':>16} {'paired p50, range':>26} {'CPU/call':>10} "
        f"{'per process':>11} {'spans':>9} {'joined':>9}",
    ]
    lines += [_added_line(*a) for a in added]
    lines += _notes(results)
    tiny = next((a for a in added if a[0].upstream == "tiny"), None)
    if tiny:
        lines += verdict(tiny, next((a for a in added if a[0].upstream == "scripted"), None))
    return "\n".join(lines)


def _figures(r: Result, variant: str) -> dict[str, float]:
    """One variant's steady calls against one upstream: p50 and mean latency, CPU per call, per-process cost."""
    xs, runs = r.steady(variant), r.of(variant)
    return {
        "p50": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "p90": percentile(xs, 0.9),
        "calls": len(xs),
        "cpu": sum(x.loop_cpu for x in runs) / len(xs),
        "fixed": statistics.median(x.fixed for x in runs),
    }


def _variant_line(r: Result, variant: str, f: dict[str, float]) -> str:
    return (
        f"{r.upstream:<9} {variant:<13} {f['calls']:>5} {f['p50'] * 1e3:>8.3f} "
        f"{f['mean'] * 1e3:>8.3f} {f['p90'] * 1e3:>8.3f} "
        f"{f['cpu'] * 1e6:>11.0f} {f['fixed'] * 1e3:>10.0f}"
    )


def _added_line(r: Result, p: dict[str, float], i: dict[str, float], pairs: list[float]) -> str:
    """What instrumentation adds against one upstream, and how many of its calls reached the store."""

    def pct(a: float, b: float) -> str:
        return f"{(b - a) * 1e6:+6.0f} µs {(b / a - 1) * 100:+5.1f}%"

    n = len(r.instrumented_ids())
    paired = f"{statistics.median(pairs) * 1e6:+.0f} ({min(pairs) * 1e6:+.0f}..{max(pairs) * 1e6:+.0f}) µs"
    return (
        f"{r.upstream:<9} {pct(p['p50'], i['p50']):>16} {pct(p['mean'], i['mean']):>16} {paired:>26} "
        f"{(i['cpu'] - p['cpu']) * 1e6:>+7.0f} µs {(i['fixed'] - p['fixed']) * 1e3:>+8.0f} ms "
        f"{r.spans_found:>4}/{n:<4} {r.joined:>4}/{n:<4}"
    )


def _notes(results: list[Result]) -> list[str]:
    """What the columns mean, the gateway span count, and the machine's load while the figures were taken."""
    total = sum(r.calls_total for r in results)
    load, cores = os.getloadavg()[:2], os.cpu_count() or 1
    busy = (
        ": BUSY, other processes competed for the cores, so wall-time figures are inflated and "
        "noisy (extra CPU per call costs more wall time when cores are oversubscribed); CPU/call "
        "is the steadier figure"
    )
    return [
        "",
        "paired p50: median over processes pairs of the p50 difference within a pair (the range is the noise)",
        "CPU/call: agent process CPU (all threads, exporter included) in the timed loop, per call",
        "per process: wall time outside calls (startup + exit, incl. the final span flush); opentelemetry-"
        "instrument's once-per-process cost",
        "spans: timed instrumented calls whose response id arrived on an `openai.chat` span in the store; "
        "joined: of those, with the gateway's span as its child (W3C traceparent)",
        f"gateway spans in the store: {results[0].gateway_spans}/{total} calls (plain and warm-up too)",
        f"machine: {cores} cores, load average {load[0]:.1f} (1 min), {load[1]:.1f} (5 min)"
        + (busy if max(load) > cores else ""),
    ]


def verdict(tiny: tuple, scripted: tuple | None) -> list[str]:
    """The 2 % target, judged by the larger of two estimates: the direct one (instrumented vs. plain
    against the tiny engine), whose noise can exceed 2 % on a busy machine, and the scripted
    upstream's absolute added µs over the tiny engine's plain p50 (per-call instrumentation work
    does not depend on how long the model takes, so this one is free of model-time noise)."""
    _, p, i, pairs = tiny
    direct = (i["p50"] / p["p50"] - 1) * 100
    lo, hi = min(pairs) / p["p50"] * 100, max(pairs) / p["p50"] * 100
    lines = [
        f"target <= 2 % added per call vs. the tiny-model engine (plain p50 {p['p50'] * 1e3:.1f} ms):",
        f"  measured directly  {direct:+6.2f} %  (process pairs ranged {lo:+.1f} .. {hi:+.1f} %"
        + ("; noise wider than the target" if hi - lo > 4 else "")
        + ")",
    ]
    worst = direct
    if scripted:
        _, sp, si, _ = scripted
        derived = (si["p50"] - sp["p50"]) / p["p50"] * 100
        worst = max(direct, derived)
        lines.append(
            f"  from absolute cost {derived:+6.2f} %  (scripted added p50 {(si['p50'] - sp['p50']) * 1e6:+.0f} µs "
            "/ tiny plain p50)"
        )
    lines.append(f"  -> {'met' if worst <= 2 else 'NOT met'} (judged by the larger)")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--calls", type=int, default=80, help="LLM calls per agent process (default: %(default)s)"
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=4,
        help="agent processes per variant and upstream, alternating ABBA (default: %(default)s)",
    )
    ap.add_argument(
        "--upstream",
        choices=["both", "tiny", "scripted"],
        default="both",
        help="tiny: embedded CPU engine (relative cost); scripted: instant answers (absolute "
        "cost); default: %(default)s",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="tokens the tiny model generates per call, exactly (ignore_eos) (default: %(default)s)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="model dir for the tiny upstream (default: the tiny model, built once under --out)",
    )
    ap.add_argument(
        "--export-every-ms",
        type=int,
        default=200,
        help="OTEL_BSP_SCHEDULE_DELAY of the instrumented agent: short, so spans are exported while "
        "calls run, as in a long-lived agent; the SDK default (5000) would move every export "
        "of these short runs into the exit flush (default: %(default)s)",
    )
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="torch threads of the tiny engine: one keeps it steady on a small shared machine "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--warmup-calls",
        type=int,
        default=2,
        help="calls of one untimed process per variant before the timed ones; 0: none (default: %(default)s)",
    )
    ap.add_argument(
        "--out",
        default=str(OUT),
        help="directory for the tiny model (built once) and the span store (replaced each run) "
        "(default: bench/out/agent_overhead)",
    )
    args = ap.parse_args(argv)
    if args.calls < 2 or args.reps < 1:
        ap.error("--calls must be >= 2 (the first call of each process is warm-up) and --reps >= 1")
    return args


def run(args: argparse.Namespace) -> list[Result]:
    """Bench each chosen upstream behind its own collector and gateway, all writing one store; then check it."""
    store = Path(args.out) / "store"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    results = []
    for name in ("scripted", "tiny") if args.upstream == "both" else (args.upstream,):
        upstream = (
            tiny_upstream(args)
            if name == "tiny"
            else Server(("127.0.0.1", 0), ScriptedUpstream).start_background()
        )
        try:
            results.append(bench_upstream(name, upstream, store, args))
        finally:
            upstream.stop()
    count_spans(store, results)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(report(run(args), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
