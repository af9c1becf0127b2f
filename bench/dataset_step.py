"""A round's dataset step in a fresh process, as cron's ``tracerl train --once`` pays it (issue #32.3a).

Targets: <= 1 s for 48 calls, <= 10 s for 10,000. Each measurement runs in its own fresh process:
``import trainer.rounds`` (torch comes with it; the CLI pays it before any round) is timed apart
from ``trainer.dataset_step.dataset_step`` (DuckDB over the store, selection, feedback window, samples),
which is what the round's ``timings.dataset`` reports. Calls carry recorded token ids, as the
demo's do (the gateway records them); ``eager`` loads the tokenizer up front as the trainer did
before (transformers import + ``AutoTokenizer``), ``retokenized`` has rows without ids, which need it.

    python bench/dataset_step.py                 # 48 and 10,000 calls, tiny model's tokenizer
    python bench/dataset_step.py --model DIR     # a real model's tokenizer (e.g. SmolLM2-135M)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_rows(n: int, *, with_ids: bool, seed: int = 0) -> list[dict]:
    """``n`` calls of 2-call rollouts, 8 rollouts a task, demo-sized (185-token prompt, 17-token answer)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rid = f"r{i // 2}"
        prompt = [rng.randrange(3, 300) for _ in range(185)]
        response = [rng.randrange(3, 300) for _ in range(17)]
        rows.append(
            {
                "transition_id": f"{rid}-{i % 2}-{uuid.UUID(int=rng.getrandbits(128)).hex[:8]}",
                "rollout_id": rid,
                "task_id": f"task{i // 16}",
                "trace_id": uuid.UUID(int=rng.getrandbits(128)).hex,
                "span_id": uuid.UUID(int=rng.getrandbits(128)).hex[:16],
                "step": i % 2,
                "agent_name": "writer",
                "trainable": True,
                "model": "policy",
                "policy_version": 0,
                "prompt_messages": json.dumps([{"role": "user", "content": f"task {i // 16}: write a line"}]),
                "tools": None,
                "response_message": json.dumps({"role": "assistant", "content": f"a line {i}"}),
                "finish_reason": "stop",
                "prompt_token_ids": prompt if with_ids else [],
                "response_token_ids": response if with_ids else [],
                "response_logprobs": [-1.0] * 17 if with_ids else None,
                "token_source": "gateway" if with_ids else "retokenized",
                "reward": float(i % 3),
                "rollout_reward": float(i % 3),
                "reward_source": "span",
                "is_last": i % 2 == 1,
                "started_at": None,
                "ended_at": None,
                "input_tokens": 185,
                "output_tokens": 17,
            }
        )
    return rows


def write_store(root: Path, n: int, with_ids: bool) -> Path:
    import pyarrow as pa

    from schemas.tables import TRANSITIONS_SCHEMA
    from store.layout import StoreLayout
    from store.parquet import write_table_atomic

    table = pa.Table.from_pylist(make_rows(n, with_ids=with_ids), schema=TRANSITIONS_SCHEMA)
    write_table_atomic(
        table, StoreLayout.at(root).partition("transitions", "2026-11-27") / "part-0.parquet", "transitions"
    )
    return root


def child(store: str, model: str, eager: bool) -> dict:
    """One fresh process: imports, then the dataset step, timed apart."""
    t0 = time.perf_counter()
    from store.location import parse_store
    from trainer.config import TrainSettings
    from trainer.dataset_step import dataset_step

    t1 = time.perf_counter()
    settings = TrainSettings(store=store, model=model, progress=False)
    step = dataset_step(settings, parse_store(store), 0, 0, Path(model))
    if eager:
        step.tokenizer.get()  # what the trainer did before: transformers + AutoTokenizer in every round
    t2 = time.perf_counter()
    return {
        "imports_s": t1 - t0,
        "dataset_s": t2 - t1,
        "samples": len(step.samples),
        "tokenizer_loaded": step.tokenizer.loaded,
        "retokenized": step.stats.n_retokenized,
    }


def run(store: Path, model: Path, eager: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", str(store), "--model", str(model)] + (
        ["--eager"] if eager else []
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="model directory (tokenizer); default: a tiny one built here"
    )
    p.add_argument("--calls", type=int, nargs="+", default=[48, 10_000])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per config; the best is printed")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.eager)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else None
        if model is None:
            from serving.models.tiny_model import build_tiny_model

            model = build_tiny_model(Path(tmp) / "model", seed=0)
        configs = [(n, "ids", False) for n in args.calls] + [(n, "eager", True) for n in args.calls]
        configs.append((args.calls[0], "retokenized", False))
        stores = {}
        for n, kind, _ in configs:
            with_ids = kind != "retokenized"
            if (n, with_ids) not in stores:
                stores[(n, with_ids)] = write_store(Path(tmp) / f"store-{n}-{with_ids}", n, with_ids)
        results = {}
        for _ in range(args.repeats):  # interleaved, so load hits every config alike
            for n, kind, eager in configs:
                r = run(stores[(n, kind != "retokenized")], model, eager)
                best = results.get((n, kind))
                if best is None or r["dataset_s"] < best["dataset_s"]:
                    results[(n, kind)] = r
        print(
            f"dataset step in a fresh process, best of {args.repeats}, load {os.getloadavg()[0]:.2f} "
            f"({os.cpu_count()} cores), model {model.name}"
        )
        print(
            f"{'calls':>7} {'rows':<12} {'imports s':>10} {'dataset s':>10} {'tokenizer':>10} {'target':>8}"
        )
        for (n, kind), r in results.items():
            target = "" if kind != "ids" else ("<= 1 s" if n <= 48 else "<= 10 s")
            print(
                f"{n:>7} {kind:<12} {r['imports_s']:>10.2f} {r['dataset_s']:>10.2f} "
                f"{'loaded' if r['tokenizer_loaded'] else 'not used':>10} {target:>8}"
            )
        print(
            "ids: recorded token ids (the demo's); eager: the same, tokenizer loaded up front (the trainer "
            "before this change); retokenized: rows without ids"
        )


if __name__ == "__main__":
    main()
