"""Packed rows through the varlen attention path on CPU: the row cut into its segments by one ``split``
(``trainer/attention.py``) against a slice per segment (the path before it), forward and backward.

Why it matters: the backward of each slice fills a zero tensor the size of the whole row and the autograd
engine adds them up, so a row of n segments wrote n full-size gradients of q, k and v per layer; a split's
backward is one concatenation. Both run in one process, interleaved, the same model and rows; the ratio is
measured in this run. A 4-layer Qwen2 shape (hidden 256) on 1 thread, one 8k-token row of 64 samples.

    python bench/segment_split.py [--samples 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trainer.attention as attention
from trainer.dataset import Sample, assign_weights
from trainer.packing import make_batches, sequence_logprobs


def slice_per_segment(q, k, v, row, scale, groups):  # the baseline: the path before, as it was
    parts = []
    for s in row:
        prefix = None
        if s.has_prefix:
            prefix = (k[:, :, s.prefix_start : s.prefix_end], v[:, :, s.prefix_start : s.prefix_end])
        own = (q[:, :, s.start : s.end], k[:, :, s.start : s.end], v[:, :, s.start : s.end])
        parts.append(attention._segment_attention(*own, prefix, scale))
    done = row[-1].end if row else 0
    if done < q.shape[2]:
        parts.append(v[:, :, done:].repeat_interleave(groups, dim=1))
    return torch.cat(parts, dim=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7, help="steps per path after one warm-up each, interleaved")
    args = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=32768)
    model = Qwen2ForCausalLM(Qwen2Config(**shape))
    attention.use_attention(model, "varlen")
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(args.samples):
        n = int(torch.randint(64, 192, (1,), generator=g))
        ids = torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist()
        samples.append(Sample(f"t{i}", f"r{i}", ids[: n * 3 // 4], ids[n * 3 // 4 :], None, advantage=1.0))
    assign_weights(samples, "rollout")
    batches = make_batches(samples, 128 * args.samples, 0)
    segments = sum(len(r) for b in batches for r in b.sample_spans)
    print(f"{len(batches)} batch(es), {segments} segments, {sum(b.n_tokens for b in batches)} tokens")

    def step() -> None:
        model.zero_grad()
        for b in batches:
            (sequence_logprobs(model, b, b.weights > 0) * b.weights).sum().backward()

    paths = {"slice per segment": slice_per_segment, "one split": attention._segments_row}
    times: dict[str, list[float]] = {name: [] for name in paths}
    original = attention._segments_row
    try:
        for i in range(args.repeats + 1):
            for name in list(paths)[:: 1 if i % 2 == 0 else -1]:
                attention._segments_row = paths[name]
                t = time.perf_counter()
                step()
                if i:
                    times[name].append(time.perf_counter() - t)
    finally:
        attention._segments_row = original
    for name, ts in times.items():
        print(f"  {name:<18} best {min(ts):.3f} s  median {statistics.median(ts):.3f} s")
    best = {name: min(ts) for name, ts in times.items()}
    print(f"one split / slice per segment: {best['one split'] / best['slice per segment']:.2f}x "
          f"(best of {args.repeats}; load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
