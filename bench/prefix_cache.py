"""The embedded engine's prefix cache on the real-model demo's prompts: generation wall time with vs without.

Two ``ModelEngine``s on the same model in this process, one with prefix caching (the default) and one
with ``enable_prefix_caching=False``, generate for the same requests, batch by batch in turn: the demo's writer prompts
(system + schema + worked example + a question from examples/demo/sql_tasks.py) in batches of
``--batch`` (the server's --max-num-seqs), then rewriter prompts (system + schema + the question, a
draft and its result), with the same seeds, greedy or sampled. It prints the wall time of each phase
and the ratio without/with, checks that both engines sampled the same tokens, and reports the cache's
hits. The first batch of each engine pays for what the cache has not seen yet; later ones reuse it.
Sequences end at the model's end token or ``--max-tokens`` (32, the real demo's), as the demo's calls
do; both engines sample the same tokens (checked), so they do the same decoding work.

    python bench/prefix_cache.py                        # SmolLM2 (build: tracerl init-model ... --from smollm2-135m-instruct)
    python bench/prefix_cache.py --questions 24 --batch 8 --max-tokens 32 --threads 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _shared import load_script  # noqa: E402

DEMO = ROOT / "examples" / "demo"
DEFAULT_MODEL = ROOT / ".models" / "smollm2-135m-instruct"


def demo_prompts(questions: int) -> dict[str, list[list[dict]]]:
    """Writer and rewriter messages of the demo agent for the first ``questions`` training questions
    (templates interleaved, so a batch mixes SQL shapes as a round does)."""
    tasks = load_script(DEMO / "sql_tasks.py", "bench_sql_tasks")
    agent = load_script(DEMO / "sql_agent.py", "bench_sql_agent")
    with tempfile.TemporaryDirectory() as tmp:
        train = tasks.questions(tasks.build_db(Path(tmp) / "shop.db"))["train"]
    by_template: dict[str, list[dict]] = {}
    for t in train:
        by_template.setdefault(t["id"].split("-")[1], []).append(t)
    rounds = itertools.zip_longest(*by_template.values())
    mixed = [t for group in rounds for t in group if t is not None][:questions]
    if len(mixed) < questions:
        raise SystemExit(f"--questions {questions}: the demo has only {len(mixed)} training questions")
    writer = [agent.writer_messages(t["question"]) for t in mixed]
    rewriter = [agent.rewriter_messages(t["question"], t["gold_sql"], "[(3,)]") for t in mixed]
    return {"writer": writer, "rewriter": rewriter}


def run(
    model_dir: Path,
    questions: int = 24,
    batch: int = 8,
    max_tokens: int = 32,
    temperature: float = 1.0,
    threads: int = 1,
) -> dict:
    import torch

    from serving.engine import GenerationJob, ModelEngine, SamplingParams

    torch.set_num_threads(threads)
    engines = {"cache": ModelEngine(model_dir), "plain": ModelEngine(model_dir, enable_prefix_caching=False)}
    prompts = {
        role: [engines["cache"].render_chat(m) for m in msgs]
        for role, msgs in demo_prompts(questions).items()
    }
    timings: dict[str, dict[str, float]] = {name: {role: 0.0 for role in prompts} for name in engines}
    tokens: dict[str, list] = {name: [] for name in engines}
    for role, ids in prompts.items():
        for k, b in enumerate(range(0, len(ids), batch)):
            jobs = [
                GenerationJob(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=b + i))
                for i, p in enumerate(ids[b : b + batch])
            ]
            # batch by batch, in alternating order, so a change of machine load hits both engines alike
            for name in list(engines)[:: 1 if k % 2 == 0 else -1]:
                start = time.perf_counter()
                out = engines[name].generate_batch(jobs)
                timings[name][role] += time.perf_counter() - start
                tokens[name] += [(b, c.index, c.token_ids) for o in out for c in o]
    tokens = {name: sorted(t) for name, t in tokens.items()}
    cache = engines["cache"].prefix_cache
    total = {name: sum(t.values()) for name, t in timings.items()}
    same = sum(a == b for a, b in zip(tokens["cache"], tokens["plain"], strict=True))
    return {
        "model": str(model_dir),
        "questions": questions,
        "batch": batch,
        "max_tokens": max_tokens,
        "threads": threads,
        "prompt_tokens": {r: sum(map(len, v)) / len(v) for r, v in prompts.items()},
        "seconds": timings,
        "total_s": total,
        "speedup": total["plain"] / total["cache"],
        "speedup_by_role": {r: timings["plain"][r] / timings["cache"][r] for r in prompts},
        "same_tokens": f"{same}/{len(tokens['plain'])}",
        "cache": {
            "entries": len(cache),
            "mb": cache.bytes / 2**20,
            "lookups": cache.queries,
            "hits": cache.hits,
            "hit_tokens": cache.hit_tokens,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the result here")
    a = ap.parse_args()
    if not (a.model / "config.json").is_file():
        sys.exit(
            f"{a.model} is not a model directory; build it with "
            f"`tracerl init-model {a.model} --from smollm2-135m-instruct`"
        )
    r = run(a.model, a.questions, a.batch, a.max_tokens, a.temperature, a.threads)
    for name, t in r["seconds"].items():
        print(
            f"{name:6s} "
            + "  ".join(f"{role} {s:6.2f} s" for role, s in t.items())
            + f"  total {r['total_s'][name]:6.2f} s"
        )
    print(f"prompt tokens (mean): {r['prompt_tokens']}; same sampled tokens: {r['same_tokens']}")
    print(
        f"speedup (plain / cache): {r['speedup']:.2f}x  by role: "
        + ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup_by_role"].items())
    )
    print(f"cache: {r['cache']}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
