"""Attention memory of packed rows: the dense L x L mask against the memory-efficient paths (issue #32.5).

CPU (default): one training step (forward, PPO-style weighted logprob loss, backward) on a packed
row of 4k, 8k and 16k tokens, each config in a fresh process; the step's peak memory is the
process's peak RSS (``getrusage``) minus its RSS just before the step, so model and data are not
counted. Paths: ``dense`` (explicit ``[R, 1, L, L]`` mask, sdpa) and ``varlen`` (per-segment sdpa,
``trainer/attention.py``). FlexAttention has no backward on CPU in torch 2.13, so it is not a CPU
training path; ``--flex-forward`` adds its no-grad scoring for comparison.

CUDA (``--device cuda``): a Qwen2.5-1.5B-shaped model with random weights (no hub), full weights and
LoRA r16, one optimizer step over packed rows of up to 16k tokens through ``TorchBackend.train``
(dense, flex, varlen) and through a bare loop (autocast bf16 forward, weighted logprob loss,
backward, AdamW) on the same rows with the same attention path; best of N interleaved runs.
Prints tokens/s, MFU of ``--peak-tflops`` (989: H100/H200 bf16 dense) and
``torch.cuda.max_memory_allocated`` per config. ``--quick`` fits in ~5 minutes on one H200.

    python bench/attention_memory.py                       # CPU: 4k/8k/16k, dense vs varlen
    python bench/attention_memory.py --device cuda --quick # GPU summary table
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.attention import use_attention
from trainer.dataset import Sample, assign_weights
from trainer.packing import make_batches, sequence_logprobs

QWEN_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
CPU_MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=32768,
)


def packed_samples(
    total: int, sample_len: int, vocab: int, seed: int = 0, shared: bool = False
) -> list[Sample]:
    """Samples of ``sample_len`` tokens (3/4 prompt, 1/4 response) filling ``total`` tokens; with
    ``shared``, groups of 4 answer one prompt (a tree per group)."""
    g = torch.Generator().manual_seed(seed)
    out: list[Sample] = []
    prompt_len = sample_len * 3 // 4
    head: list[int] = []
    for i in range(total // sample_len):
        if not shared or i % 4 == 0:
            head = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        resp = torch.randint(3, vocab, (sample_len - prompt_len,), generator=g).tolist()
        lps = (-torch.rand(len(resp), generator=g)).tolist()
        out.append(Sample(f"t{i}", f"r{i}", head, resp, lps, advantage=float(torch.randn(1, generator=g))))
    assign_weights(out, "rollout")
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its current RSS, so the
    peak read after the step is the step's own (getrusage's ru_maxrss never goes down)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def cpu_child(tokens: int, mode: str, sample_len: int, grad: bool) -> dict:
    """One config in this (fresh) process: build, then measure the step's peak RSS over the baseline."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Qwen2ForCausalLM(Qwen2Config(**CPU_MODEL, attn_implementation="sdpa"))
    use_attention(model, mode)
    (batch,) = make_batches(packed_samples(tokens, sample_len, CPU_MODEL["vocab_size"]), tokens)
    _reset_peak_rss()
    base = _status_kib("VmRSS")
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        lp = sequence_logprobs(model, batch, batch.weights > 0)
        loss = -(lp * batch.advantages * batch.weights).sum()
        if grad:
            loss.backward()
    peak = _status_kib("VmHWM")
    return {
        "tokens": tokens,
        "mode": mode,
        "grad": grad,
        "step_peak_mib": (peak - base) / 1024,
        "base_mib": base / 1024,
        "process_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": float(loss.detach()),
    }


def run_cpu(args: argparse.Namespace) -> None:
    configs = [(t, m, True) for t in args.tokens for m in ("dense", "varlen")]
    if args.flex_forward:
        configs += [(t, m, False) for t in args.tokens for m in ("dense", "flex")]
    results = {}
    for tokens, mode, grad in configs:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--tokens",
            str(tokens),
            "--mode",
            mode,
            "--sample-len",
            str(args.sample_len),
        ] + ([] if grad else ["--no-grad"])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            print(f"{tokens} {mode}: failed ({out.stderr.strip().splitlines()[-1:]})")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results[(tokens, mode, grad)] = r
        print(
            f"  {tokens:>6} tokens  {mode:<6} {'train' if grad else 'score'}: step peak {r['step_peak_mib']:8.1f} MiB"
            f"  (loss {r['loss']:.4f})",
            flush=True,
        )
    print(
        f"\nstep peak memory over baseline (MiB), {args.sample_len}-token samples, "
        f"{CPU_MODEL['num_hidden_layers']} layers x {CPU_MODEL['num_attention_heads']} heads, "
        f"fresh process per config, load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'tokens':>7} {'pass':>6} {'dense':>10} {'efficient':>10} {'dense/eff':>10}")
    for grad, other in ((True, "varlen"), (False, "flex")):
        for t in args.tokens:
            d, e = results.get((t, "dense", grad)), results.get((t, other, grad))
            if d and e:
                print(
                    f"{t:>7} {'train' if grad else 'score':>6} {d['step_peak_mib']:>10.1f} "
                    f"{e['step_peak_mib']:>10.1f} {d['step_peak_mib'] / max(e['step_peak_mib'], 1e-9):>9.1f}x"
                    f"  ({other})"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384], help="row lengths (CPU)")
    p.add_argument("--sample-len", type=int, default=1024, help="tokens per packed sample")
    p.add_argument("--flex-forward", action="store_true", help="CPU: also score (no grad) dense vs flex")
    p.add_argument("--quick", action="store_true", help="CUDA: fewer repeats and rows (~5 min on one H200)")
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="CUDA: the card's bf16 dense peak, for MFU"
    )
    p.add_argument(
        "--configs",
        default="",
        help="CUDA/smoke: only these, comma-separated weights:loop:attention[:ac][:compile][:parts][:profile] "
        "(e.g. full:ours:varlen,lora:ours:varlen:ac; ac = --activation-checkpointing, compile = --compile-blocks, "
        "parts = compile the layers' parts rather than whole layers, profile = one more step under the profiler)",
    )
    p.add_argument(
        "--profile", action="store_true", help="CUDA/smoke: one more step per config under torch.profiler"
    )
    p.add_argument("--smoke", action="store_true", help="the GPU bench's code path on CPU with a small model")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="dense", help=argparse.SUPPRESS)
    p.add_argument("--no-grad", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(cpu_child(args.tokens[0], args.mode, args.sample_len, not args.no_grad)))
    elif args.device == "cpu" and not args.smoke:
        run_cpu(args)
    else:
        from _attention_cuda import run_cuda  # this script's folder is on sys.path

        run_cuda(args, QWEN_1_5B)


if __name__ == "__main__":
    main()
