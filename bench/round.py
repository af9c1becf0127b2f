"""One real-model round of the loop vs bare ``model.generate`` + a bare torch step, in one run (issue #14).

The loop: ``tracerl serve`` (SmolLM2-135M-Instruct, one thread), ``tracerl gateway`` and
``tracerl collect`` as processes; rollouts of the demo's two-agent letter task, each a trace with
the agent's own GenAI spans and the gateway's token span, rewards posted to the collector; then
conversion (``convert_store``) and one LoRA training round (``run_once``: load, train, save,
publish to the server). The agents run as threads of this process (``examples/demo/agent.py``'s
functions), not as processes: a Python process start is the agent's cost, not the loop's.

The baseline, on the very prompts the loop's calls sent (their recorded token ids): the same
model in this process, ``model.generate`` on the writer prompts then on the rewriter prompts
(batches of the server's --max-num-seqs), and one bare LoRA policy-gradient step (forward,
log-softmax gather, -A*logp, backward, AdamW) on the recorded responses with the same LoRA rank,
threads and autocast as the trainer. Target: the loop adds <= 15 % over bare generate + bare step.

    python bench/round.py                          # 8 rollouts (2 tasks x 4), 16 tokens per call
    python bench/round.py --samples 8 --max-tokens 32 --json bench/out/round.json
"""

from __future__ import annotations

import argparse
import json
import os
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


def start_stack(model: Path, work: Path, threads: int, max_num_seqs: int):
    """collect, serve and gateway as `tracerl` processes on free ports (the demo's process handling)."""
    from tracerl.demo import BIN, Child, Children, http_ok, pick_port, tcp_open

    taken: set[int] = set()
    grpc, http, serve, gw = (pick_port(0, "", taken) for _ in range(4))
    tracerl, logs, children = str(BIN / "tracerl"), work / "logs", Children()
    collector = children.start(
        Child(
            "collect",
            [
                tracerl,
                "collect",
                "--store",
                str(work / "store"),
                "--grpc",
                f"127.0.0.1:{grpc}",
                "--http",
                f"127.0.0.1:{http}",
                "--segment-age-s",
                "0.2",
            ],
            logs / "collect.log",
        )
    )
    server = children.start(
        Child(
            "serve",
            [
                tracerl,
                "serve",
                "--model",
                str(model),
                "--listen",
                f"127.0.0.1:{serve}",
                "--threads",
                str(threads),
                "--max-num-seqs",
                str(max_num_seqs),
            ],
            logs / "serve.log",
        )
    )
    gateway = children.start(
        Child(
            "gateway",
            [
                tracerl,
                "gateway",
                "--upstream",
                f"http://127.0.0.1:{serve}",
                "--listen",
                f"127.0.0.1:{gw}",
                "--otlp",
                f"http://127.0.0.1:{grpc}",
                "--models-ttl-s",
                "0.5",
            ],
            logs / "gateway.log",
        )
    )
    collector.wait_healthy(lambda: tcp_open(grpc) and tcp_open(http), 60)
    server.wait_healthy(lambda: http_ok(f"http://127.0.0.1:{serve}/health"), 300)
    gateway.wait_healthy(lambda: http_ok(f"http://127.0.0.1:{gw}/health"), 60)
    urls = {
        "otlp": f"http://127.0.0.1:{grpc}",
        "collector": f"http://127.0.0.1:{http}",
        "server": f"http://127.0.0.1:{serve}",
        "gateway": f"http://127.0.0.1:{gw}/v1",
    }
    return children, urls


def rollouts(agent, reward, tasks: list[dict], samples: int, collector: str) -> list[str]:
    """Each (task, sample) as the demo agent's main(), in a thread; its trace id is its rollout id."""
    import httpx
    from opentelemetry import trace

    tracer = trace.get_tracer("bench.round")

    def one(task: dict) -> str:
        letter = task["letter"]
        with tracer.start_as_current_span(
            "demo letter task", attributes={"tracerl.task_id": task["id"]}
        ) as root:
            draft = agent.invoke_agent("writer", agent.user(agent.writer_prompt(letter)))
            final = agent.invoke_agent("rewriter", agent.user(agent.rewriter_prompt(letter, draft)))
        rid = format(root.get_span_context().trace_id, "032x")
        value = reward.score(task, json.dumps({"letter": letter, "writer": draft, "final": final}))
        httpx.post(
            f"{collector}/v1/rewards", json={"rollout_id": rid, "value": value}, timeout=30
        ).raise_for_status()
        return rid

    with ThreadPoolExecutor(max_workers=len(tasks) * samples) as pool:
        return list(pool.map(one, [t for t in tasks for _ in range(samples)]))


def round_transitions(store: Path) -> list[dict]:
    from schemas.views import connect_readonly

    con = connect_readonly(str(store))
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
) -> dict:
    """``repeats`` rounds (round k trains on policy@k's rollouts), each followed by the baseline on that
    round's prompts; every phase's figure is its fastest repeat (the least disturbed by other load)."""
    import torch
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store
    from tracerl.demo import wait_for_round
    from trainer.backends.torch_backend import autocast_dtype
    from trainer.config import TrainSettings
    from trainer.publish import server_publisher
    from trainer.rounds import run_once

    torch.set_num_threads(threads)
    os.environ.update({"DEMO_MAX_TOKENS": str(max_tokens), "DEMO_TEMPERATURE": "1.0", "OPENAI_API_KEY": ""})
    work = Path(tempfile.mkdtemp(prefix="tracerl-bench-round-"))
    store = work / "store"
    tok, lora = bare_model(
        model, lora_rank
    )  # also imports transformers + peft, as a `train --watch` process has
    dtype = autocast_dtype(torch.device("cpu"), True)

    def autocast():
        return torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)

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
    children, urls = start_stack(model, work, threads, max_num_seqs)
    reps: list[dict] = []
    try:
        provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=urls["otlp"], insecure=True), schedule_delay_millis=200
            )
        )
        trace.set_tracer_provider(provider)
        os.environ["OPENAI_BASE_URL"] = urls["gateway"]
        agent, reward = (
            load_script(DEMO / "agent.py", "bench_demo_agent"),
            load_script(DEMO / "reward.py", "bench_demo_reward"),
        )
        tasks = [{"id": f"letter-{c}", "letter": c, "letters": letters} for c in letters]
        settings.server = urls["server"]
        agent.invoke_agent("warm-up", agent.user("Hi"))  # warm-up: the server's first forward pass, connections (not part of a round)
        lora.eval()
        with torch.no_grad():
            bare_generate(
                lora, [tok("Hi").input_ids], 2, 1, tok.pad_token_id
            )  # its warm-up, as the server had
        for _ in range(repeats):
            r: dict = {}
            t0 = time.perf_counter()
            ids = rollouts(agent, reward, tasks, samples, urls["collector"])
            r["generation_s"] = time.perf_counter() - t0
            provider.force_flush()
            wait_for_round(store, ids, len(ids), 120, children.check_alive)
            r["collect_wait_s"] = time.perf_counter() - t0 - r["generation_s"]
            t = time.perf_counter()
            convert_store(str(store), ConvertConfig(quiet_s=0.0, workers=1))
            r["convert_s"] = time.perf_counter() - t
            t = time.perf_counter()
            outcome = run_once(settings, publisher=server_publisher(urls["server"]), log=lambda _m: None)
            r["train_round_s"] = time.perf_counter() - t
            if outcome.status != "published":
                raise RuntimeError(f"the round did not publish: {outcome.status} {outcome.message}")
            r["train_round_parts_s"] = json.loads(outcome.row.get("timings") or "{}")
            round_ids = set(ids)
            rows = [row for row in round_transitions(store) if row["rollout_id"] in round_ids]
            r["generated_tokens"] = sum(len(row["response_token_ids"]) for row in rows)
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
        children.stop_all()

    def best(key: str) -> float:
        return min(x[key] for x in reps)

    loop = best("generation_s") + best("collect_wait_s") + best("convert_s") + best("train_round_s")
    bare = best("bare_generate_s") + best("bare_step_s")
    fastest_train = min(reps, key=lambda x: x["train_round_s"])
    return {
        "rollouts_per_round": len(tasks) * samples,
        "calls_per_round": 2 * len(tasks) * samples,
        "max_tokens": max_tokens,
        "threads": threads,
        "repeats": reps,
        "loop": {
            "generation_s": best("generation_s"),
            "collect_wait_s": best("collect_wait_s"),
            "convert_s": best("convert_s"),
            "train_round_s": best("train_round_s"),
            "train_round_parts_s": fastest_train["train_round_parts_s"],
            "total_s": loop,
            "generation_tokens_per_s": max(x["generated_tokens"] / x["generation_s"] for x in reps),
            "train_tokens_per_s": max(x["step_tokens"] / x["train_round_parts_s"]["train"] for x in reps),
        },
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
        "target": "loop_over_bare <= 1.15",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="HF model dir (default: SmolLM2 in .models/, built with init-model --from if missing)",
    )
    p.add_argument("--letters", default="ae", help="one task per letter")
    p.add_argument("--samples", type=int, default=4, help="rollouts per task")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server, trainer and baseline")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds, each beside its baseline; the fastest of each phase counts",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    if a.model == DEFAULT_MODEL:
        from serving.pretrained import build_pretrained

        build_pretrained("smollm2-135m-instruct", DEFAULT_MODEL)
    r = run(a.model, a.letters, a.samples, a.max_tokens, a.lora_rank, a.threads, repeats=a.repeats)
    lp, bp = r["loop"], r["bare"]
    per_round = ", ".join(f"{x['loop_over_bare']:.2f}x" for x in r["repeats"])
    print(
        f"{r['rollouts_per_round']} rollouts a round, {r['calls_per_round']} calls of <= {r['max_tokens']} tokens, "
        f"{r['threads']} thread(s); fastest of {len(r['repeats'])} rounds per phase (loop/bare by round: {per_round})"
    )
    print(
        f"loop : generation {lp['generation_s']:.1f}s ({lp['generation_tokens_per_s']:.1f} tok/s) + spans stored "
        f"{lp['collect_wait_s']:.1f}s + convert {lp['convert_s']:.1f}s + train round {lp['train_round_s']:.1f}s "
        f"{ {k: round(v, 1) for k, v in lp['train_round_parts_s'].items()} } = {lp['total_s']:.1f}s"
    )
    print(
        f"bare : generate {bp['generate_s']:.1f}s ({bp['generation_tokens_per_s']:.1f} tok/s) + step "
        f"{bp['step_s']:.1f}s ({bp['train_tokens_per_s']:.0f} tok/s) = {bp['total_s']:.1f}s"
    )
    print(
        f"loop / bare = {r['loop_over_bare']:.2f}x (target <= 1.15x): generation {r['generation_loop_over_bare']:.2f}x, "
        f"training {r['training_loop_over_bare']:.2f}x"
    )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
