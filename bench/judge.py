"""Judge cost per rollout: one group prompt with the shared prefix once vs judging each rollout alone.

On groups of 8 built like the demo's SQL task (examples/demo: the writer's few-shot prompt, its draft
run on the real SQLite database, the rewriter's fresh prompt with the result, its reply), this counts
the judge's prompt tokens per rollout with the real SmolLM2 tokenizer and chat template (no server):

    python bench/judge.py                       # tokens only (needs .models/smollm2-135m-instruct:
                                                #   tracerl init-model .models/smollm2-135m-instruct --from smollm2-135m-instruct)
    python bench/judge.py --server http://127.0.0.1:8000/v1 --model policy   # plus one timed pass each way

Target (issue 28): group tokens per rollout <= 0.5x those of judging each rollout alone. Drafts are drawn
from the gold query and the demo's typical mistakes (the few-shot copy, a wrong table, no WHERE clause,
prose), seeded, so every run builds the same groups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo"
# this file is named judge.py: its own directory must not shadow the judge package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
for p in (str(REPO), str(DEMO)):
    if p not in sys.path:
        sys.path.insert(0, p)

from judge.agreement import agreement  # noqa: E402
from judge.prompts import JudgeRequest, default_rubric, group_request, pointwise_request  # noqa: E402
from judge.trajectories import Call, Rollout  # noqa: E402

MODEL = REPO / ".models" / "smollm2-135m-instruct"


def drafts_for(gold: str, rng: random.Random) -> list[str]:
    """Eight drafts for one question: right ones and the demo's usual mistakes."""
    table = gold.split(" FROM ", 1)[1].split()[0] if " FROM " in gold else "customers"
    pool = [
        gold,
        gold,
        "SELECT name FROM customers WHERE city = 'Oslo'",
        gold.replace(table, table.rstrip("s")),
        gold.split(" WHERE ")[0],
        f"SELECT * FROM {table}",
        "I think the answer is in the customers table.",
        gold.replace("SELECT ", "SELECT DISTINCT "),
    ]
    rng.shuffle(pool)
    return pool


def demo_groups(n_tasks: int, seed: int = 0) -> tuple[list[list[Rollout]], dict[str, float]]:
    """``n_tasks`` groups of 8 rollouts, each a writer call and a rewriter call as the demo's agent makes
    them, and each rollout's reward from the demo's own grader (examples/demo/sql_reward.py)."""
    from sql_agent import execute, extract_sql, rewriter_messages, writer_messages
    from sql_reward import score
    from sql_tasks import build_db, questions

    rng = random.Random(seed)
    db = Path(tempfile.mkdtemp(prefix="judge-bench-")) / "shop.db"
    build_db(db)
    tasks = questions(db)["train"][:n_tasks]
    groups, grades = [], {}
    for t in tasks:
        group = []
        for j, draft in enumerate(drafts_for(t["gold_sql"], rng)):
            sql = extract_sql(draft)
            result = execute(str(db), sql)
            fixed = draft if rng.random() < 0.6 else t["gold_sql"]
            calls = [
                Call(0, writer_messages(t["question"]), {"role": "assistant", "content": draft}, "writer"),
                Call(
                    1,
                    rewriter_messages(t["question"], sql, result),
                    {"role": "assistant", "content": fixed},
                    "rewriter",
                ),
            ]
            group.append(Rollout(f"{t['id']}-{j}", t["id"], calls))
            grades[group[-1].rollout_id] = score(t, json.dumps({"sql": extract_sql(fixed) or sql}))
        groups.append(group)
    return groups, grades


def count_tokens(tokenizer, req: JudgeRequest) -> int:
    text = tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_figures(groups: list[list[Rollout]], tokenizer, rubric: str) -> dict[str, float]:
    group_tokens = sum(count_tokens(tokenizer, group_request(g[0].task_id, g, rubric)) for g in groups)
    alone_tokens = sum(count_tokens(tokenizer, pointwise_request(r, rubric)) for g in groups for r in g)
    n = sum(len(g) for g in groups)
    return {
        "rollouts": n,
        "group_per_rollout": group_tokens / n,
        "alone_per_rollout": alone_tokens / n,
        "ratio": group_tokens / alone_tokens,
    }


async def timed(url: str, model: str, requests: list[JudgeRequest], concurrency: int) -> dict[str, float]:
    import httpx

    from judge.client import JudgeClient, judge_all

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        outcomes = await judge_all(JudgeClient(http, url, model), requests, concurrency)
    return {
        "seconds": time.perf_counter() - t0,
        "prompt_tokens": sum(o.prompt_tokens for o in outcomes),
        "completion_tokens": sum(o.completion_tokens for o in outcomes),
        "ok": sum(o.status == "ok" for o in outcomes),
        "requests": len(outcomes),
        "scores": {
            rid: o.parsed.scores[tid].score
            for o in outcomes
            if o.status == "ok" and o.parsed and o.parsed.scores
            for tid, rid in zip(o.request.ids, o.request.rollout_ids)
        },
    }


def _fmt(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=4, help="groups of 8 (default: 4, a demo round)")
    ap.add_argument("--server", help="an OpenAI-compatible judge URL for one timed pass each way")
    ap.add_argument("--model", default="policy", help="the judge's served model name (with --server)")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args(argv)
    if not MODEL.is_dir():
        print(
            f"no {MODEL}; build it with: tracerl init-model {MODEL} --from smollm2-135m-instruct",
            file=sys.stderr,
        )
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rubric = default_rubric()
    groups, grades = demo_groups(args.tasks)
    f = token_figures(groups, tokenizer, rubric)
    print(
        f"judge prompt tokens per rollout (SmolLM2 tokenizer, {f['rollouts']} rollouts in groups of 8, demo SQL task):"
    )
    print(f"  group, shared prefix once: {f['group_per_rollout']:.0f}")
    print(f"  each rollout alone:        {f['alone_per_rollout']:.0f}")
    print(f"  ratio: {f['ratio']:.2f}x (target <= 0.50x) {'OK' if f['ratio'] <= 0.5 else 'MISSED'}")
    if args.server:
        grouped = [group_request(g[0].task_id, g, rubric) for g in groups]
        alone = [pointwise_request(r, rubric) for g in groups for r in g]
        for name, reqs in (("group", grouped), ("alone", alone)):
            t = asyncio.run(timed(args.server, args.model, reqs, args.concurrency))
            n = f["rollouts"]
            print(
                f"  {name}: {t['seconds'] / n:.2f} s/rollout, {t['prompt_tokens'] / n:.0f} prompt + "
                f"{t['completion_tokens'] / n:.0f} completion tokens/rollout (server's counts), "
                f"{t['ok']}/{t['requests']} answers parsed"
            )
            scored = sorted(t["scores"])
            a = agreement([t["scores"][r] for r in scored], [grades[r] for r in scored], threshold=1.0)
            print(
                f"    agreement with the demo's grader over {a.n} scored rollouts ({a.n_pass} pass = gold result): "
                f"spearman {_fmt(a.spearman)}, AUC {_fmt(a.auc)}; judge scores {sorted(set(t['scores'].values()))}"
            )
    return 0 if f["ratio"] <= 0.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
