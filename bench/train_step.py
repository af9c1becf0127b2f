"""Trainer step cost, two ratios (issue #5 targets: overhead <= 1.10x, packing >= 1.5x).

1. overhead: one ``TorchBackend.train`` step (PPO-clip loss, importance correction, weights,
   grad clipping, metrics) vs a bare torch loop (forward, log-softmax gather, -A*logp, backward,
   AdamW step) on the same model and the same packed micro-batches.
2. packing: tokens/s of the same ``TorchBackend.train`` on packed rows vs on padded batches
   (samples in arrival order, ``--rows`` per batch, padded to the longest) for skewed lengths:
   most calls short, a few long, as agent traces are.

    python bench/train_step.py                      # CPU, a ~3M-parameter Qwen2
    python bench/train_step.py --hidden 512 --layers 8 --device cuda
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from serving.models.tiny_model import build_tiny_model
from trainer.backends.torch_backend import TorchBackend
from trainer.config import TrainSettings
from trainer.dataset import Sample, assign_weights
from trainer.packing import make_batches, make_padded_batches, sequence_logprobs


def skewed_samples(n: int, vocab: int, long_len: int, seed: int) -> list[Sample]:
    """~85% short calls (16-96 tokens), ~15% long ones (up to ``long_len``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        total = (
            int(torch.randint(16, 96, (1,), generator=g))
            if torch.rand(1, generator=g) < 0.85
            else int(torch.randint(long_len // 2, long_len, (1,), generator=g))
        )
        prompt = max(4, total // 2)
        ids = torch.randint(3, vocab, (total,), generator=g).tolist()
        lps = (-torch.rand(total - prompt, generator=g) * 3).tolist()
        out.append(
            Sample(
                f"t{i}",
                f"r{i // 2}",
                ids[:prompt],
                ids[prompt:],
                lps,
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    assign_weights(out, "rollout")
    return out


def timed(fns: dict, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` seconds per function, run interleaved (A B C A B C ...) so that load from
    other processes on a shared machine hits every candidate alike; the minimum is the least
    disturbed run."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    return {name: min(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--long", type=int, default=768, help="length of the long calls")
    ap.add_argument("--pack-tokens", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8, help="samples per padded batch")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads; 1 keeps timings stable on a shared machine"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            Path(tmp) / "m",
            hidden=args.hidden,
            layers=args.layers,
            heads=4,
            kv_heads=2,
            intermediate=args.hidden * 2,
        )
        settings = TrainSettings(model=str(path), lr=1e-6, progress=False, device=args.device)
        ours = TorchBackend.load(settings, path, None)
    device = ours.device
    vocab = ours.model.config.vocab_size
    n_params = sum(p.numel() for p in ours.model.parameters())
    samples = skewed_samples(args.samples, vocab, args.long, seed=0)
    n_tokens = sum(s.length for s in samples)
    packed = [b.to(device) for b in make_batches(samples, args.pack_tokens)]
    padded = [b.to(device) for b in make_padded_batches(samples, args.rows)]
    print(
        f"model: {n_params / 1e6:.2f}M params on {device}; {len(samples)} samples, {n_tokens} tokens "
        f"(longest {max(s.length for s in samples)}); {len(packed)} packed rows of <= {args.pack_tokens}, "
        f"{len(padded)} padded batches of {args.rows}"
    )

    bare_model = copy.deepcopy(ours.model)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-6)

    def bare_step() -> None:
        for b in packed:
            logp = sequence_logprobs(bare_model, b)
            loss = -(logp * b.advantages * b.weights).sum()
            loss.backward()
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    t = timed(
        {"bare": bare_step, "ours": lambda: ours.train(packed), "padded": lambda: ours.train(padded)},
        args.repeats,
    )
    t_bare, t_ours, t_padded = t["bare"], t["ours"], t["padded"]
    padded_slots = sum(b.input_ids.numel() for b in padded)
    packed_slots = sum(b.input_ids.numel() for b in packed)
    print(f"bare torch step     {t_bare * 1e3:8.1f} ms")
    print(f"tracerl step        {t_ours * 1e3:8.1f} ms   (packed)")
    print(
        f"tracerl step        {t_padded * 1e3:8.1f} ms   (padded: {padded_slots} token slots for {n_tokens} tokens, "
        f"packed uses {packed_slots})"
    )
    print(f"packed {n_tokens / t_ours:,.0f} tok/s vs padded {n_tokens / t_padded:,.0f} tok/s")
    print(f"RATIO overhead (ours / bare)     = {t_ours / t_bare:.3f}   target <= 1.10")
    print(f"RATIO packing  (packed / padded) = {t_padded / t_ours:.3f}   target >= 1.5")


if __name__ == "__main__":
    main()
