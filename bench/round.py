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

Engine start and warm-up (vLLM on CPU: 30-170 s to start, 15-20 s for its first request) are
reported but not counted. Other targets: a round (generation + spans stored + conversion +
training round with publish) <= 60 s on 2 cores; publish <= 5 s.

    python bench/round.py                          # vllm then embedded; 8 rollouts (2 tasks x 4), 16 tokens
    python bench/round.py --engines embedded --samples 8 --max-tokens 32 --json bench/out/round.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _shared import load_script  # noqa: E402

DEMO = ROOT / "examples" / "demo"
DEFAULT_MODEL = ROOT / ".models" / "smollm2-135m-instruct"
ENGINES = ("vllm", "embedded")
TARGETS = {"gateway_over_direct": 0.9, "round_s": 60.0, "publish_s": 5.0}


def start_stack(
    model: Path,
    work: Path,
    threads: int,
    max_num_seqs: int,
    engine: str = "embedded",
    publish: str = "auto",
    lora_rank: int = 8,
):
    """collect, serve and gateway as `tracerl` processes on free ports (tracerl/stack.py, as the demo starts
    them); the caller stops the returned children."""
    from tracerl.stack import StackConfig
    from tracerl.stack import start_stack as start
    from tracerl.supervisor import Children

    serve_args = ["--max-num-seqs", str(max_num_seqs)]
    if engine == "vllm":  # as the demo runs it: merged full-weight publishes, unless LoRA is asked for
        serve_args += ["--max-model-len", "1024"]
        serve_args += (
            ["--max-lora-rank", str(max(16, lora_rank))] if publish == "lora" else ["--no-enable-lora"]
        )
    else:
        serve_args += ["--threads", str(threads)]
    cfg = StackConfig(
        store=str(work / "store"),
        logs=work / "logs",
        model=str(model),
        engine=engine,
        collect_args=("--segment-age-s", "0.2"),
        serve_args=tuple(serve_args),
        gateway_args=("--models-ttl-s", "0.5"),
        serve_timeout_s=600 if engine == "vllm" else 300,
    )
    children = Children()
    try:
        stack = start(cfg, children)
    except BaseException:
        children.stop_all()
        raise
    u = stack.urls
    urls = {"otlp": u.otlp, "collector": u.collector, "server": u.server, "gateway": f"{u.gateway}/v1"}
    return children, urls


def rollouts(
    agent, reward, tasks: list[dict], samples: int, collector: str
) -> tuple[list[str], list[list[list]]]:
    """Each (task, sample) as the demo agent's main(), in a thread; its trace id is its rollout id.
    Also the chat messages of each rollout's calls, in order (for the direct replay)."""
    import httpx
    from opentelemetry import trace

    tracer = trace.get_tracer("bench.round")

    def one(task: dict) -> tuple[str, list[list]]:
        letter = task["letter"]
        with tracer.start_as_current_span(
            "demo letter task", attributes={"tracerl.task_id": task["id"]}
        ) as root:
            writer = agent.user(agent.writer_prompt(letter))
            draft = agent.invoke_agent("writer", writer)
            rewriter = agent.user(agent.rewriter_prompt(letter, draft))
            final = agent.invoke_agent("rewriter", rewriter)
        rid = format(root.get_span_context().trace_id, "032x")
        value = reward.score(task, json.dumps({"letter": letter, "writer": draft, "final": final}))
        httpx.post(
            f"{collector}/v1/rewards", json={"rollout_id": rid, "value": value}, timeout=30
        ).raise_for_status()
        return rid, [writer, rewriter]

    with ThreadPoolExecutor(max_workers=len(tasks) * samples) as pool:
        out = list(pool.map(one, [t for t in tasks for _ in range(samples)]))
    return [o[0] for o in out], [o[1] for o in out]


def served_name(server: str) -> str:
    """What the engine serves the newest policy as: ``policy@k`` for the newest loaded adapter, else ``policy``
    (what the gateway's latest-version alias resolves ``policy`` to)."""
    import httpx

    ids = [m["id"] for m in httpx.get(f"{server}/v1/models", timeout=10).json().get("data", [])]
    versions = [(int(m.group(1)), i) for i in ids if (m := re.fullmatch(r"policy@(\d+)", i))]
    return max(versions)[1] if versions else "policy"


def reset_prefix_cache(server: str) -> None:
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{server}/reset_prefix_cache", timeout=30)


def replay(
    server: str, calls: list[list[list]], max_tokens: int, temperature: float, capture: bool = False
) -> tuple[float, int]:
    """The recorded chat calls straight to the engine (no gateway, no spans): one thread per rollout, its calls
    in order, as in the round, each over its own connection with urllib as the demo agent's calls are; (seconds,
    completion tokens). ``capture``: with what the gateway adds to each request (``return_token_ids``,
    ``logprobs``), to tell the engine's cost of token capture from the proxy's."""
    import urllib.request

    model = served_name(server)
    extra = {"return_token_ids": True, "logprobs": True} if capture else {}

    def one(messages_in_order: list[list]) -> int:
        n = 0
        for messages in messages_in_order:
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "messages": messages,
                **extra,
            }
            req = urllib.request.Request(
                f"{server}/v1/chat/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                n += int((json.load(r).get("usage") or {}).get("completion_tokens") or 0)
        return n

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        t = time.perf_counter()
        tokens = sum(pool.map(one, calls))
        return time.perf_counter() - t, tokens


def round_transitions(store: Path) -> list[dict]:
    from store.location import parse_store
    from store.views import connect_readonly

    con = connect_readonly(parse_store(store))
    try:
        cur = con.execute("""SELECT agent_name, rollout_id, task_id, reward, prompt_token_ids, response_token_ids
                             FROM transitions ORDER BY rollout_id, step""")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]
    finally:
        con.close()


def bare_generate(
    model, prompts: list[list[int]], max_tokens: int, batch: int, pad: int
) -> tuple[float, int]:
    """Left-padded batches of ``model.generate`` (sampling at temperature 1); (seconds, new tokens)."""
    import torch

    t, new = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=pad,
        )
        new += int((out[:, width:] != pad).sum())
    return time.perf_counter() - t, new


def bare_step(model, rows: list[dict], lr: float, autocast) -> tuple[float, int]:
    """One policy-gradient step, -A*logp over every response token, advantages = reward - task mean."""
    import torch

    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["task_id"], []).append(r["reward"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    t = time.perf_counter()
    seqs = [r["prompt_token_ids"] + r["response_token_ids"] for r in rows]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    resp = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        p = len(r["prompt_token_ids"])
        resp[i, p - 1 : p - 1 + len(r["response_token_ids"])] = 1
    adv = torch.tensor([r["reward"] - sum(groups[r["task_id"]]) / len(groups[r["task_id"]]) for r in rows])
    with autocast():
        logits = model(input_ids=ids).logits[:, :-1].float()
    logp = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
    loss = -(adv[:, None] * logp * resp).sum() / resp.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t, int(sum(map(len, seqs)))


def bare_model(model: Path, lora_rank: int):
    """The baseline's model: the base weights under a fresh LoRA of the trainer's shape (zero B: same outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.config import TrainSettings

    tok = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    s = TrainSettings()
    targets = s.lora_targets if s.lora_targets == "all-linear" else s.lora_targets.split(",")
    cfg = LoraConfig(
        r=lora_rank, lora_alpha=s.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets
    )
    return tok, get_peft_model(base, cfg)


@contextlib.contextmanager
def timed_merges(out: list[float]):
    """Within: each ``trainer.merge.merge_adapter`` call's seconds appended to ``out`` (the publisher imports it
    when it publishes), to split a merged publish into merge and reload."""
    import trainer.merge as merge

    real = merge.merge_adapter

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            out.append(time.perf_counter() - t)

    merge.merge_adapter = timed
    try:
        yield
    finally:
        merge.merge_adapter = real


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


def run_engine(
    engine: str,
    model: Path,
    ctx: dict,
    *,
    letters: str,
    samples: int,
    max_tokens: int,
    lora_rank: int,
    threads: int,
    max_num_seqs: int,
    lr: float,
    repeats: int,
    publish: str,
) -> dict:
    """``repeats`` rounds on ``engine`` (round k trains on policy@k's rollouts), each followed by the direct replay
    of its calls (before its training: same policy) and the baseline on its prompts; every phase's figure is its
    fastest repeat (the least disturbed by other load)."""
    import torch
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from loop.watch import wait_for_round
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store
    from store.location import parse_store
    from trainer.config import TrainSettings
    from trainer.publish import server_publisher
    from trainer.rounds import run_once

    agent, reward, provider, tok, lora, autocast = (
        ctx[k] for k in ("agent", "reward", "provider", "tok", "lora", "autocast")
    )
    work = Path(tempfile.mkdtemp(prefix=f"tracerl-bench-round-{engine}-"))
    store = work / "store"
    settings = TrainSettings(
        store=str(store),
        model=str(model),
        min_rollouts=2,
        lr=lr,
        lora_rank=lora_rank,
        threads=threads,
        max_prompt_tokens=256,
        max_response_tokens=max_tokens,
        pack_tokens=256 + max_tokens,
        progress=False,
    )
    t = time.perf_counter()
    children, urls = start_stack(model, work, threads, max_num_seqs, engine, publish, lora_rank)
    started_s = time.perf_counter() - t
    reps: list[dict] = []
    try:
        ctx["switch"].switch(OTLPSpanExporter(endpoint=urls["otlp"], insecure=True))
        sys.modules["genai_chat"].BASE_URL = urls["gateway"]  # the agents' OPENAI_BASE_URL, read at import
        tasks = [{"id": f"letter-{c}", "letter": c, "letters": letters} for c in letters]
        settings.server = urls["server"]
        # warm-up (not part of a round): the engine's first forward passes (vLLM on CPU: 15-20 s), a full batch
        # of the round's shape straight to it, the gateway's connections
        t = time.perf_counter()
        agent.invoke_agent("warm-up", agent.user("Hi"))
        warm = [
            [agent.user(agent.writer_prompt(task["letter"]))] * 2 for task in tasks for _ in range(samples)
        ]
        replay(urls["server"], warm, max_tokens, 1.0)
        warmup_s = time.perf_counter() - t
        for _ in range(repeats):
            r: dict = {}
            reset_prefix_cache(urls["server"])
            t0 = time.perf_counter()
            ids, calls = rollouts(agent, reward, tasks, samples, urls["collector"])
            r["generation_s"] = time.perf_counter() - t0
            provider.force_flush()
            wait_for_round(parse_store(store), ids, len(ids), 120, children.check_alive)
            r["collect_wait_s"] = time.perf_counter() - t0 - r["generation_s"]
            t = time.perf_counter()
            convert_store(parse_store(store), ConvertConfig(quiet_s=0.0, workers=1))
            r["convert_s"] = time.perf_counter() - t
            round_ids = set(ids)
            rows = [row for row in round_transitions(store) if row["rollout_id"] in round_ids]
            r["generated_tokens"] = sum(len(row["response_token_ids"]) for row in rows)
            r["generation_tokens_per_s"] = r["generated_tokens"] / r["generation_s"]

            reset_prefix_cache(
                urls["server"]
            )  # the round's prompts are cached: the replay must not gain by it
            r["direct_s"], r["direct_tokens"] = replay(urls["server"], calls, max_tokens, 1.0)
            r["direct_tokens_per_s"] = r["direct_tokens"] / r["direct_s"]
            r["gateway_over_direct"] = r["generation_tokens_per_s"] / r["direct_tokens_per_s"]
            reset_prefix_cache(urls["server"])
            r["direct_capture_s"], r["direct_capture_tokens"] = replay(
                urls["server"], calls, max_tokens, 1.0, True
            )
            r["direct_capture_tokens_per_s"] = r["direct_capture_tokens"] / r["direct_capture_s"]

            merges: list[float] = []
            t = time.perf_counter()
            with timed_merges(merges):
                outcome = run_once(
                    settings, publisher=server_publisher(urls["server"], publish), log=lambda _m: None
                )
            r["train_round_s"] = time.perf_counter() - t
            r["publish_merge_s"] = sum(merges)
            if outcome.status != "published":
                raise RuntimeError(f"the round did not publish: {outcome.status} {outcome.message}")
            r["train_round_parts_s"] = json.loads(outcome.row.get("timings") or "{}")
            r["publish_s"] = r["train_round_parts_s"].get("publish", float("nan"))
            r["loop_s"] = r["generation_s"] + r["collect_wait_s"] + r["convert_s"] + r["train_round_s"]

            lora.eval()
            with torch.no_grad():  # the writers' calls, then the rewriters' (each needs its writer's answer)
                gens = [
                    bare_generate(
                        lora,
                        [x["prompt_token_ids"] for x in rows if x["agent_name"] == agent_name],
                        max_tokens,
                        max_num_seqs,
                        tok.pad_token_id,
                    )
                    for agent_name in ("writer", "rewriter")
                ]
            lora.train()
            r["bare_generate_s"], r["bare_generated_tokens"] = (
                sum(g[0] for g in gens),
                sum(g[1] for g in gens),
            )
            r["bare_step_s"], r["step_tokens"] = bare_step(lora, rows, lr, autocast)
            r["bare_s"] = r["bare_generate_s"] + r["bare_step_s"]
            r["loop_over_bare"] = r["loop_s"] / r["bare_s"]
            reps.append(r)
    finally:
        provider.force_flush()
        ctx["switch"].switch(None)
        children.stop_all()

    def best(key: str) -> float:
        return min(x[key] for x in reps)

    loop = best("generation_s") + best("collect_wait_s") + best("convert_s") + best("train_round_s")
    bare = best("bare_generate_s") + best("bare_step_s")
    fastest_train = min(reps, key=lambda x: x["train_round_s"])
    gen_tps = max(x["generation_tokens_per_s"] for x in reps)
    direct_tps = max(x["direct_tokens_per_s"] for x in reps)
    fastest_publish = min(reps, key=lambda x: x["publish_s"])
    return {
        "engine": engine,
        "publish": publish,
        "start_s": started_s,
        "warmup_s": warmup_s,
        "work_dir": str(work),
        "repeats": reps,
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
    import torch
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from trainer.backends.torch_backend import autocast_dtype

    torch.set_num_threads(threads)
    os.environ.update({"DEMO_MAX_TOKENS": str(max_tokens), "DEMO_TEMPERATURE": "1.0", "OPENAI_API_KEY": ""})
    tok, lora = bare_model(
        model, lora_rank
    )  # also imports transformers + peft, as a `train --watch` process has
    dtype = autocast_dtype(torch.device("cpu"), True)

    def autocast():
        return torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)

    switch = switch_exporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
    provider.add_span_processor(BatchSpanProcessor(switch, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    agent, reward = (
        load_script(DEMO / "agent.py", "bench_demo_agent"),
        load_script(DEMO / "reward.py", "bench_demo_reward"),
    )
    lora.eval()
    with torch.no_grad():
        bare_generate(lora, [tok("Hi").input_ids], 2, 1, tok.pad_token_id)  # its warm-up, as the server had
    lora.train()
    ctx = {
        "agent": agent,
        "reward": reward,
        "provider": provider,
        "tok": tok,
        "lora": lora,
        "autocast": autocast,
        "switch": switch,
    }
    per_engine = {}
    try:
        for engine in engines:
            per_engine[engine] = run_engine(
                engine,
                model,
                ctx,
                letters=letters,
                samples=samples,
                max_tokens=max_tokens,
                lora_rank=lora_rank,
                threads=threads,
                max_num_seqs=max_num_seqs,
                lr=lr,
                repeats=repeats,
                publish=publish,
            )
    finally:
        provider.shutdown()
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
