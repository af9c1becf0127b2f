"""Training on shared prompt prefixes vs plain packing: one round's step, same samples, one run.

A group's samples answer one prompt, so plain packing recomputes that prompt once per sample.
``trainer/packing.py`` lays the common prefix out once with a tree mask (same gradient, tested in
tests/trainer/test_packing.py). This times ``TorchBackend.train`` (one PPO step, LoRA, bf16
autocast where the CPU has it) both ways, interleaved, best of ``--repeats``:

    python bench/shared_prefix.py --store tracerl-demo/store --version 3   # a demo round's real calls
    python bench/shared_prefix.py                                          # demo-shaped synthetic groups

Without ``--store`` the samples mimic the demo's round (measured on its run C): 4 tasks x 8
samples, the writer's 185-token prompt identical within a task with ~17-token answers, the
rewriter's ~133-token prompt sharing ~100 tokens with ~31-token answers.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from store.location import parse_store
from trainer.backends.torch_backend import TorchBackend
from trainer.config import TrainSettings
from trainer.dataset import DatasetConfig, Sample, assign_weights, build_samples, load_transitions
from trainer.packing import make_batches

REPO = Path(__file__).resolve().parents[1]


def demo_shaped(vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    out = []
    for task in range(4):
        writer, head = ids(185), ids(100)
        for j in range(8):
            adv = rng.uniform(-1, 1)
            rid = f"t{task}-{j}"
            out.append(Sample(f"{rid}-w", rid, writer, ids(rng.randint(12, 24)), None, advantage=adv))
            out.append(
                Sample(
                    f"{rid}-r",
                    rid,
                    head + ids(rng.randint(20, 45)),
                    ids(rng.randint(20, 40)),
                    None,
                    advantage=adv,
                )
            )
    assign_weights(out, "rollout")
    return out


def from_store(store: str, version: int, tokenizer, tasks: str | None) -> list[Sample]:
    from store.views import connect_readonly

    rows = load_transitions(connect_readonly(parse_store(store)), (version, version), tasks=tasks)
    samples, _ = build_samples(
        rows, tokenizer, DatasetConfig(max_prompt_tokens=512, max_response_tokens=64, estimator="rloo")
    )
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=str(REPO / ".models" / "smollm2-135m-instruct"),
        help="model directory (default: SmolLM2-135M-Instruct as `make` builds it for the tests)",
    )
    ap.add_argument("--store", help="take one round's calls from this store instead of synthetic groups")
    ap.add_argument(
        "--version", type=int, default=0, help="--store: the policy version whose calls to train on"
    )
    ap.add_argument("--tasks", default="^train-", help="--store: task id regex (the demo's training tasks)")
    ap.add_argument("--pack-tokens", type=int, default=640)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    settings = TrainSettings(
        model=args.model,
        lr=1e-3,
        lora_rank=16,
        lora_targets="q_proj,k_proj,v_proj,o_proj",
        progress=False,
        threads=args.threads,
        pack_tokens=args.pack_tokens,
    )
    backend = TorchBackend.load(settings, Path(args.model), None)
    samples = (
        from_store(args.store, args.version, backend.tokenizer, args.tasks)
        if args.store
        else demo_shaped(backend.model.config.vocab_size)
    )
    pad = backend.tokenizer.pad_token_id or 0
    batches = {
        share: make_batches(samples, args.pack_tokens, pad, share_prefix=share) for share in (False, True)
    }
    tokens = {share: sum(b.n_tokens for b in bs) for share, bs in batches.items()}
    print(
        f"{len(samples)} calls, {sum(len(s.response_ids) for s in samples)} response tokens; plain packing "
        f"{tokens[False]} tokens in {len(batches[False])} rows, shared prefixes {tokens[True]} tokens in "
        f"{len(batches[True])} rows ({tokens[False] / tokens[True]:.2f}x fewer)"
    )
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for share in (False, True):  # interleaved: load from other processes hits both alike
            t = time.perf_counter()
            backend.train(batches[share])
            times[share].append(time.perf_counter() - t)
    plain, shared = min(times[False]), min(times[True])
    print(f"train step: plain packing {plain:.1f} s, shared prefixes {shared:.1f} s ({args.threads} threads)")
    print(f"RATIO shared-prefix speedup (plain / shared) = {plain / shared:.2f}")


if __name__ == "__main__":
    main()
