"""Training-step memory of the LM head and the activations (issue #32.5): before and after chunked,
checkpointed head logprobs (``trainer/head_logprobs.py``) and ``--activation-checkpointing``.

A Qwen2.5-shaped vocabulary (151,936 tokens) on a small CPU model (LoRA r16, as a GPU user trains a
1.5B model), packed rows of 1024-token samples (a quarter of each scored), varlen attention. One
training step (forward, PPO-style weighted logprob loss, backward) per config, each in a fresh
process; the step's peak memory is the process's peak RSS minus its RSS just before the step
(``bench/attention_memory.py``'s measure). Configs:

- ``forward``: the model's own forward returns every scored position's logits at once (the path
  before this change; still the path for models that soft-cap or scale their logits);
- ``chunked``: the head a chunk of tokens at a time, checkpointed (the default now);
- ``chunked+ac``: the same with ``--activation-checkpointing``.

    python bench/logprob_memory.py                  # 4k and 8k-token rows
    python bench/logprob_memory.py --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attention_memory import (  # this script's folder is on sys.path
    _reset_peak_rss,
    _status_kib,
    packed_samples,
)

import trainer.packing as packing
from trainer.attention import use_attention
from trainer.backends.torch_backend import checkpoint_activations
from trainer.packing import make_batches, sequence_logprobs

MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
CONFIGS = ("forward", "chunked", "chunked+ac")


def child(tokens: int, config: str, sample_len: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Qwen2ForCausalLM(Qwen2Config(**MODEL, attn_implementation="sdpa"))
    use_attention(model, "varlen")
    model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    if config == "forward":
        packing.split_head = lambda _model: None
    if config.endswith("+ac"):
        checkpoint_activations(model)
    model.train()
    (batch,) = make_batches(packed_samples(tokens, sample_len, MODEL["vocab_size"]), tokens)
    _reset_peak_rss()
    base = _status_kib("VmRSS")
    lp = sequence_logprobs(model, batch, batch.weights > 0)
    loss = -(lp * batch.advantages * batch.weights).sum()
    loss.backward()
    peak = _status_kib("VmHWM")
    return {
        "tokens": tokens,
        "config": config,
        "scored": int((batch.weights > 0).sum()),
        "step_peak_mib": (peak - base) / 1024,
        "loss": float(loss.detach()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192], help="row lengths")
    p.add_argument("--sample-len", type=int, default=1024, help="tokens per packed sample")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.tokens[0], args.child, args.sample_len)))
        return
    rows = {}
    for t in args.tokens:
        for c in CONFIGS:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    c,
                    "--tokens",
                    str(t),
                    "--sample-len",
                    str(args.sample_len),
                ],
                capture_output=True,
                text=True,
                timeout=3600,
            )
            if out.returncode != 0:
                print(f"{t} {c}: failed ({out.stderr.strip().splitlines()[-1:]})", flush=True)
                continue
            rows[(t, c)] = r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"  {t:>6} tokens ({r['scored']} scored)  {c:<10} step peak {r['step_peak_mib']:8.1f} MiB"
                f"  loss {r['loss']:.6f}",
                flush=True,
            )
    print(
        f"\nstep peak memory over baseline (MiB); vocab {MODEL['vocab_size']}, "
        f"{MODEL['num_hidden_layers']} layers, LoRA r16; load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'tokens':>7} " + " ".join(f"{c:>11}" for c in CONFIGS) + "  forward/chunked  forward/chunked+ac")
    for t in args.tokens:
        r = [rows.get((t, c)) for c in CONFIGS]
        if all(r):
            f, c, a = (x["step_peak_mib"] for x in r)
            print(f"{t:>7} {f:>11.1f} {c:>11.1f} {a:>11.1f}  {f / c:>14.2f}x  {f / a:>17.2f}x")


if __name__ == "__main__":
    main()
