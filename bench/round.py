"""Real-model rounds of the loop, per engine, vs bare ``model.generate`` + a bare torch step (issues #14, #19).

Per engine (``--engines vllm,embedded``, both by default, one after the other in this process):

* the loop: ``tracerl serve`` (SmolLM2-135M-Instruct), ``tracerl gateway`` and ``tracerl collect``
  as processes; rollouts of the demo's two-agent letter task, each a trace with the agent's own
  GenAI spans and the gateway's token span, rewards posted to the collector; then conversion
  (``convert_store``) and one LoRA training round (``run_once``: load, train, save, publish to the
  server; its ``timings`` give model_load / train / save / publish). The agents run as threads of
  this process (``examples/demo/agent.py``'s functions): a Python process start is the agent's
  cost, not the loop's. ``--engine vllm`` is real vLLM as the demo starts it
  (``--no-enable-lora --max-model-len 1024``: a round is published as merged full weights,
  reloaded in place); ``--publish lora`` keeps LoRA on and loads the adapter by name instead.
* gateway vs direct: the round's recorded chat messages (writer, then rewriter with the writer's
  recorded draft, one thread per rollout as in the round) replayed straight to the engine, same
  max_tokens / temperature / concurrency, no gateway, no spans; the prefix cache is reset before
  the round and before the replay. Target: round generation through the gateway >= 0.9x the
  direct replay's tokens/s.
* the baseline, on the very prompts the loop's calls sent (their recorded token ids): the same
  model in this process, ``model.generate`` on the writer prompts then on the rewriter prompts
  (batches of the server's --max-num-seqs), and one bare LoRA policy-gradient step (forward,
  log-softmax gather, -A*logp, backward, AdamW) on the recorded responses with the same LoRA
  rank, threads and autocast as the trainer.

The parts, one job each: ``_round_loop.py`` (the stack, the rollouts, conversion and the training round),
``_round_replay.py`` (the direct replay) and ``_round_baseline.py`` (the bare model); this file runs them per
engine, keeps each phase's fastest repeat and prints the figures.

Engine start and warm-up (vLLM on CPU: 30-170 s to start, 15-20 s for its first request) are
reported but not counted. Other targets: a round (generation + spans stored + conversion +
training round with publish) <= 60 s on 2 cores; publish <= 5 s.

    python bench/round.py                          # vllm then embedded; 8 rollouts (2 tasks x 4), 16 tokens
    python bench/round.py --engines embedded --samples 8 --max-tokens 32 --json bench/out/round.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _round_baseline import bare_generate, bare_model, bare_round, generating  # noqa: E402
from _round_loop import generate_and_convert, start_stack, train_round  # noqa: E402
from _round_replay import direct_replays, replay  # noqa: E402
from _shared import load_script  # noqa: E402

DEMO = ROOT / "examples" / "demo"
DEFAULT_MODEL = ROOT / ".models" / "smollm2-135m-instruct"
ENGINES = ("vllm", "embedded")
TARGETS = {"gateway_over_direct": 0.9, "round_s": 60.0, "publish_s": 5.0}


def switch_exporter():
    """A span exporter whose target can change: one process-wide tracer provider (OTel allows one), its spans
    sent to the current engine's collector."""
    from opentelemetry.sdk.trace.export import SpanExporter

    class SwitchExporter(SpanExporter):
        def __init__(self) -> None:
            self.target = None

        def switch(self, target) -> None:
            old, self.target = self.target, target
            if old is not None:
                old.shutdown()

        def export(self, spans):
            from opentelemetry.sdk.trace.export import SpanExportResult

            return self.target.export(spans) if self.target is not None else SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self.switch(None)

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return SwitchExporter()


@dataclass(frozen=True)
class Shape:
    """What every engine's rounds are run with (``run``'s arguments)."""

    letters: str
    samples: int
    max_tokens: int
    lora_rank: int
    threads: int
    max_num_seqs: int
    lr: float
    repeats: int
    publish: str


def run_engine(engine: str, model: Path, ctx: dict, shape: Shape) -> dict:
    """``shape.repeats`` rounds on ``engine`` (round k trains on policy@k's rollouts), each followed by the direct
    replay of its calls (before its training: same policy) and the baseline on its prompts; every phase's figure
    is its fastest repeat (the least disturbed by other load)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    work = Path(tempfile.mkdtemp(prefix=f"tracerl-bench-round-{engine}-"))
    t = time.perf_counter()
    children, urls = start_stack(
        model, work, shape.threads, shape.max_num_seqs, engine, shape.publish, shape.lora_rank
    )
    started_s = time.perf_counter() - t
    settings = train_settings(work / "store", model, shape, urls["server"])
    reps: list[dict] = []
    try:
        ctx["switch"].switch(OTLPSpanExporter(endpoint=urls["otlp"], insecure=True))
        sys.modules["genai_chat"].BASE_URL = urls["gateway"]  # the agents' OPENAI_BASE_URL, read at import
        tasks = [{"id": f"letter-{c}", "letter": c, "letters": shape.letters} for c in shape.letters]
        warmup_s = warm_up(ctx["agent"], tasks, shape, urls["server"])
        for _ in range(shape.repeats):
            reps.append(one_round(ctx, tasks, shape, urls, children, settings))
    finally:
        ctx["provider"].force_flush()
        ctx["switch"].switch(None)
        children.stop_all()
    figures = summarize(reps)
    return {
        "engine": engine,
        "publish": shape.publish,
        "start_s": started_s,
        "warmup_s": warmup_s,
        "work_dir": str(work),
        "repeats": reps,
        **figures,
    }


def train_settings(store: Path, model: Path, shape: Shape, server: str):
    """The training round's settings: LoRA of ``shape.lora_rank``, every call of the round kept whole."""
    from trainer.config import TrainSettings

    return TrainSettings(
        store=str(store),
        model=str(model),
        server=server,
        min_rollouts=2,
        lr=shape.lr,
        lora_rank=shape.lora_rank,
        threads=shape.threads,
        max_prompt_tokens=256,
        max_response_tokens=shape.max_tokens,
        pack_tokens=256 + shape.max_tokens,
        progress=False,
    )


def warm_up(agent, tasks: list[dict], shape: Shape, server: str) -> float:
    """Not part of a round: the engine's first forward passes (vLLM on CPU: 15-20 s), a full batch of the
    round's shape straight to it, the gateway's connections; its seconds."""
    t = time.perf_counter()
    agent.invoke_agent("warm-up", agent.user("Hi"))
    warm = [
        [agent.user(agent.writer_prompt(task["letter"]))] * 2 for task in tasks for _ in range(shape.samples)
    ]
    replay(server, warm, shape.max_tokens, 1.0)
    return time.perf_counter() - t


def one_round(ctx: dict, tasks: list[dict], shape: Shape, urls: dict, children, settings) -> dict:
    """One round of the loop (generation through the gateway, spans stored, conversion, training round with
    publish), the direct replay of its calls before it trains, and the baseline on its transitions."""
    r, rows, calls = generate_and_convert(ctx, tasks, shape.samples, urls, children, settings.store)
    r.update(direct_replays(urls["server"], calls, shape.max_tokens))
    r["gateway_over_direct"] = r["generation_tokens_per_s"] / r["direct_tokens_per_s"]
    r.update(train_round(settings, urls["server"], shape.publish))
    r["loop_s"] = r["generation_s"] + r["collect_wait_s"] + r["convert_s"] + r["train_round_s"]
    r.update(
        bare_round(
            ctx["tok"], ctx["lora"], rows, shape.max_tokens, shape.max_num_seqs, shape.lr, ctx["autocast"]
        )
    )
    r["loop_over_bare"] = r["loop_s"] / r["bare_s"]
    return r


def summarize(reps: list[dict]) -> dict:
    """An engine's figures over its rounds: each phase's fastest repeat, the throughputs' best, the targets."""

    def best(key: str) -> float:
        return min(x[key] for x in reps)

    loop = best("generation_s") + best("collect_wait_s") + best("convert_s") + best("train_round_s")
    bare = best("bare_generate_s") + best("bare_step_s")
    fastest_train = min(reps, key=lambda x: x["train_round_s"])
    gen_tps = max(x["generation_tokens_per_s"] for x in reps)
    direct_tps = max(x["direct_tokens_per_s"] for x in reps)
    fastest_publish = min(reps, key=lambda x: x["publish_s"])
    return {
        "loop": {
            "generation_s": best("generation_s"),
            "collect_wait_s": best("collect_wait_s"),
            "convert_s": best("convert_s"),
            "train_round_s": best("train_round_s"),
            "train_round_parts_s": fastest_train["train_round_parts_s"],
            "publish_s": best("publish_s"),
            "publish_merge_s": fastest_publish["publish_merge_s"],
            "total_s": loop,
            "generation_tokens_per_s": gen_tps,
            "train_tokens_per_s": max(x["step_tokens"] / x["train_round_parts_s"]["train"] for x in reps),
        },
        "direct": {
            "generation_s": best("direct_s"),
            "generation_tokens_per_s": direct_tps,
            "capture_generation_s": best("direct_capture_s"),
            "capture_generation_tokens_per_s": max(x["direct_capture_tokens_per_s"] for x in reps),
        },
        "gateway_over_direct": gen_tps / direct_tps,
        "bare": {
            "generate_s": best("bare_generate_s"),
            "step_s": best("bare_step_s"),
            "total_s": bare,
            "generation_tokens_per_s": max(x["bare_generated_tokens"] / x["bare_generate_s"] for x in reps),
            "train_tokens_per_s": max(x["step_tokens"] / x["bare_step_s"] for x in reps),
        },
        "loop_over_bare": loop / bare,
        "generation_loop_over_bare": best("generation_s") / best("bare_generate_s"),
        "training_loop_over_bare": best("train_round_s") / best("bare_step_s"),
        "targets_met": {
            "gateway_over_direct": gen_tps / direct_tps >= TARGETS["gateway_over_direct"],
            "round_s": loop <= TARGETS["round_s"],
            "publish_s": best("publish_s") <= TARGETS["publish_s"],
        },
    }


def run(
    model: Path,
    letters: str = "ae",
    samples: int = 4,
    max_tokens: int = 16,
    lora_rank: int = 8,
    threads: int = 1,
    max_num_seqs: int = 8,
    lr: float = 1e-4,
    repeats: int = 2,
    engines: tuple[str, ...] = ENGINES,
    publish: str = "auto",
) -> dict:
    """Each engine in turn, its own stack and store, in this one process (one tracer provider, one baseline
    model: the loop's and the baseline's figures of every engine come from the same run)."""
    shape = Shape(letters, samples, max_tokens, lora_rank, threads, max_num_seqs, lr, repeats, publish)
    ctx = bench_context(model, shape)
    per_engine = {}
    try:
        for engine in engines:
            per_engine[engine] = run_engine(engine, model, ctx, shape)
    finally:
        ctx["provider"].shutdown()
    return {
        "model": str(model),
        "rollouts_per_round": len(letters) * samples,
        "calls_per_round": 2 * len(letters) * samples,
        "max_tokens": max_tokens,
        "max_num_seqs": max_num_seqs,
        "threads": threads,
        "cpus": os.cpu_count(),
        "publish": publish,
        "engines": per_engine,
        "targets": {
            "gateway_over_direct": f">= {TARGETS['gateway_over_direct']}",
            "round_s": f"<= {TARGETS['round_s']:g} (on 2 cores)",
            "publish_s": f"<= {TARGETS['publish_s']:g}",
            "loop_over_bare": "<= 1.15",
        },
    }


def bench_context(model: Path, shape: Shape) -> dict:
    """What every engine's rounds share: the demo's agent and reward scripts, the process's one tracer
    provider (its spans sent through ``switch`` to the current engine's collector), and the baseline's
    model, tokenizer and autocast, warmed up as the server is."""
    import torch
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from trainer.backends.torch_backend import autocast_dtype

    torch.set_num_threads(shape.threads)
    os.environ.update(
        {"DEMO_MAX_TOKENS": str(shape.max_tokens), "DEMO_TEMPERATURE": "1.0", "OPENAI_API_KEY": ""}
    )
    # also imports transformers + peft, as a `train --watch` process has
    tok, lora = bare_model(model, shape.lora_rank)
    dtype = autocast_dtype(torch.device("cpu"), True)

    def autocast():
        return torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)

    switch = switch_exporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
    provider.add_span_processor(BatchSpanProcessor(switch, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    agent = load_script(DEMO / "agent.py", "bench_demo_agent")
    reward = load_script(DEMO / "reward.py", "bench_demo_reward")
    with generating(lora):
        bare_generate(lora, [tok("Hi").input_ids], 2, 1, tok.pad_token_id)  # its warm-up, as the server had
    return {
        "agent": agent,
        "reward": reward,
        "provider": provider,
        "tok": tok,
        "lora": lora,
        "autocast": autocast,
        "switch": switch,
    }


def ok(flag: bool) -> str:
    return "ok" if flag else "MISSED"


def report(r: dict) -> None:
    print(
        f"{r['rollouts_per_round']} rollouts a round, {r['calls_per_round']} calls of <= {r['max_tokens']} tokens, "
        f"--max-num-seqs {r['max_num_seqs']}, {r['threads']} torch thread(s), {r['cpus']} cores; per engine the "
        f"fastest of each phase over its rounds"
    )
    for name, e in r["engines"].items():
        lp, bp, dp = e["loop"], e["bare"], e["direct"]
        per_round = ", ".join(
            f"{x['loop_s']:.1f}s (gateway / direct {x['gateway_over_direct']:.2f}x, publish "
            f"{x['publish_s']:.1f}s)"
            for x in e["repeats"]
        )
        how = {
            "vllm": "real vLLM, "
            + ("LoRA adapters" if e["publish"] == "lora" else "merged full-weight reloads"),
            "embedded": "tracerl's embedded engine",
        }.get(name, name)
        print(
            f"\n[{name}] {how}; started in {e['start_s']:.1f}s, warm-up {e['warmup_s']:.1f}s (not counted); "
            f"rounds: {per_round}"
        )
        print(
            f"  loop   : generation {lp['generation_s']:.1f}s ({lp['generation_tokens_per_s']:.1f} tok/s) + spans "
            f"stored {lp['collect_wait_s']:.1f}s + convert {lp['convert_s']:.1f}s + train round "
            f"{lp['train_round_s']:.1f}s { {k: round(v, 1) for k, v in lp['train_round_parts_s'].items()} } "
            f"= {lp['total_s']:.1f}s"
        )
        print(
            f"  direct : the same calls straight to the engine {dp['generation_s']:.1f}s "
            f"({dp['generation_tokens_per_s']:.1f} tok/s); through the gateway / direct = "
            f"{e['gateway_over_direct']:.2f}x; direct with the gateway's return_token_ids + logprobs "
            f"{dp['capture_generation_s']:.1f}s ({dp['capture_generation_tokens_per_s']:.1f} tok/s)"
        )
        print(
            f"  bare   : generate {bp['generate_s']:.1f}s ({bp['generation_tokens_per_s']:.1f} tok/s) + step "
            f"{bp['step_s']:.1f}s ({bp['train_tokens_per_s']:.0f} tok/s) = {bp['total_s']:.1f}s; loop / bare = "
            f"{e['loop_over_bare']:.2f}x (generation {e['generation_loop_over_bare']:.2f}x, training "
            f"{e['training_loop_over_bare']:.2f}x)"
        )
    print("\ntargets:")
    for name, e in r["engines"].items():
        m = e["targets_met"]
        print(
            f"  {name:8s}: gateway / direct {e['gateway_over_direct']:.2f}x (>= 0.9x) {ok(m['gateway_over_direct'])}; "
            f"round {e['loop']['total_s']:.1f}s (<= 60s on 2 cores; here {r['cpus']}) {ok(m['round_s'])}; "
            f"publish {e['loop']['publish_s']:.1f}s (<= 5s; of which merge {e['loop']['publish_merge_s']:.1f}s) "
            f"{ok(m['publish_s'])}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="HF model dir (default: SmolLM2 in .models/, built with init-model --from if missing)",
    )
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated, run in this order (vllm, embedded)"
    )
    p.add_argument(
        "--publish",
        default="auto",
        choices=["auto", "lora", "full"],
        help="the trainer's --publish (auto: merged full weights on a CPU vLLM); lora keeps vLLM's LoRA on",
    )
    p.add_argument("--letters", default="ae", help="one task per letter")
    p.add_argument("--samples", type=int, default=4, help="rollouts per task")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8, help="the engine's batch (and the baseline's)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the embedded server, trainer and baseline (vLLM binds its worker to core 0)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds per engine, each beside its direct replay and baseline; the fastest of each phase counts",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    engines = tuple(e.strip() for e in a.engines.split(",") if e.strip())
    if not engines or any(e not in ENGINES for e in engines):
        p.error(f"--engines {a.engines!r}: name one or more of {', '.join(ENGINES)}")
    if a.model == DEFAULT_MODEL:
        from serving.models.pretrained import build_pretrained

        build_pretrained("smollm2-135m-instruct", DEFAULT_MODEL)
    r = run(
        a.model,
        a.letters,
        a.samples,
        a.max_tokens,
        a.lora_rank,
        a.threads,
        a.max_num_seqs,
        repeats=a.repeats,
        engines=engines,
        publish=a.publish,
    )
    report(r)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
