"""The GPU half of bench/attention_memory.py: tokens/s, MFU and peak memory of one optimizer step over
packed rows, ``TorchBackend.train`` (per attention path) against a bare loop, full weights and LoRA r16.

Both sides hold fp32 master weights under bf16 autocast (what ``TorchBackend`` does on CUDA) and use
AdamW; the bare loop is forward (``sequence_logprobs``: the model plus the logprob gather), a
weighted ``-A * logp`` sum, backward, one optimizer step. Configs run one after another in this
process (a 1.5B model twice would not leave room to interleave them); each gets a warm-up step (flex
compiles its kernel there) and the best of ``repeats`` timed steps. Peak memory is
``torch.cuda.max_memory_allocated`` from before the model is built to after the last step: weights,
gradients, optimizer state and activations.

MFU counts model FLOPs, not hardware FLOPs: 6 x (non-embedding parameters) per token for full
weights, 4 x for LoRA (no weight gradients: forward 2N, input gradients 2N), plus attention
(12 x layers x hidden per causal (query, key) pair inside a sample) and the LM head at the positions
scored (6 x vocab x hidden each).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from trainer.attention import use_attention
from trainer.dataset import Sample, assign_weights
from trainer.packing import Batch, make_batches, sequence_logprobs


@dataclass
class Result:
    weights: str
    loop: str
    attention: str
    flags: tuple[str, ...] = ()
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_gib: float = 0.0
    step_s: float = 0.0
    error: str = ""

    @property
    def path(self) -> str:
        """The attention path and its flags as printed, e.g. ``varlen+ac+compile``."""
        return "+".join((self.attention, *(f for f in self.flags if f != "profile")))


def varied_samples(total: int, vocab: int, row_tokens: int, seed: int = 0) -> list[Sample]:
    """Samples of 1/16 to 1/4 of a row (1k-4k tokens for 16k rows; 3/4 prompt) until ``total`` tokens:
    long agent calls, as in the issue's 41.6k tokens in 3 rows of <= 16k."""
    g = torch.Generator().manual_seed(seed)
    out: list[Sample] = []
    used = 0
    while used < total:
        n = int(torch.randint(row_tokens // 16, row_tokens // 4, (1,), generator=g))
        p = n * 3 // 4
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        lps = (-torch.rand(n - p, generator=g)).tolist()
        out.append(
            Sample(
                f"t{len(out)}",
                f"r{len(out)}",
                ids[:p],
                ids[p:],
                lps,
                advantage=float(torch.randn(1, generator=g)),
            )
        )
        used += n
    assign_weights(out, "rollout")
    return out


def model_flops(model: Any, batches: list[Batch], lora: bool) -> float:
    cfg = model.config
    n = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "embed_tokens" not in name and "lora_" not in name
    )
    tokens = sum(b.n_tokens for b in batches)
    pairs = sum((e - s) * (e - s + 1) // 2 for b in batches for row in b.sample_spans for s, e in row)
    scored = sum(int((b.weights > 0).sum()) for b in batches)
    dense = (4 if lora else 6) * n * tokens
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * pairs
    head = 6 * cfg.vocab_size * cfg.hidden_size * scored
    return float(dense + attention + head)


def build(shape: dict, lora: bool, attention: str, device: torch.device) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa"))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=16, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
            ),
        )
    use_attention(model, attention)
    return model.train()


def bare_step(
    model: Any, optimizer: torch.optim.Optimizer, batches: list[Batch], device: torch.device
) -> None:
    total = float(sum(b.weights.sum() for b in batches))
    for b in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            lp = sequence_logprobs(model, b, b.weights > 0)
        (-(lp * b.advantages * b.weights).sum() / total).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def stepper(
    loop: str,
    model: Any,
    lora: bool,
    attention: str,
    batches: list[Batch],
    device: torch.device,
    checkpointing: bool = False,
    compiled: bool = False,
    whole_layers: bool = True,
) -> Any:
    """One optimizer step over ``batches``: ``TorchBackend.train`` (ours, with activation checkpointing
    and compiled blocks as ``--activation-checkpointing``/``--compile-blocks`` turn them on; ``whole_layers``
    False compiles the layers' parts, as under activation checkpointing) or the bare loop."""
    from trainer.backends.torch_backend import TorchBackend, checkpoint_activations, compile_blocks
    from trainer.config import TrainSettings

    if loop == "ours":
        if checkpointing:
            checkpoint_activations(model)
        if compiled:
            compile_blocks(model, whole_layers=whole_layers and not checkpointing)
        settings = TrainSettings(
            lr=1e-6,
            progress=False,
            lora_rank=16 if lora else 0,
            attention=attention,
            activation_checkpointing=checkpointing,
            compile_blocks=compiled,
        )
        backend = TorchBackend(model, None, settings, device)
        return lambda: backend.train(batches)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    return lambda: bare_step(model, optimizer, batches, device)


def run_config(
    shape: dict,
    weights: str,
    loop: str,
    attention: str,
    batches: list[Batch],
    repeats: int,
    device: torch.device,
    peak_tflops: float,
    flags: tuple[str, ...] = (),
    profile: bool = False,
) -> Result:
    res = Result(weights, loop, attention, flags)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = step = None
    try:
        lora = weights == "lora"
        model = build(shape, lora, attention, device)
        moved = [b.to(device) for b in batches]
        step = stepper(
            loop, model, lora, attention, moved, device, "ac" in flags, "compile" in flags, "parts" not in flags
        )
        times = []
        for i in range(repeats + 1):
            sync()
            t = time.perf_counter()
            step()
            sync()
            if i:  # the first is a warm-up (flex compiles there)
                times.append(time.perf_counter() - t)
        res.step_s = min(times)
        if profile or "profile" in flags:
            print_profile(step, device)
        res.tokens_per_s = sum(b.n_tokens for b in batches) / res.step_s
        res.mfu = model_flops(model, batches, lora) / res.step_s / (peak_tflops * 1e12)
        if device.type == "cuda":
            res.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        res.error = "OOM"
    except Exception as e:  # one config failing must not hide the others' numbers
        res.error = f"{type(e).__name__}: {str(e)[:80]}"
    model = step = None
    gc.collect()
    return res


def print_profile(step: Any, device: torch.device, top: int = 25) -> None:
    """One more step under ``torch.profiler``: the ops that take the device's time, most first (where an
    MFU short of the matmuls' own rate goes)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60), flush=True)


def parse_config(text: str) -> tuple[str, str, str, tuple[str, ...]]:
    """``weights:loop:attention[:flag...]``, flags ``ac`` (activation checkpointing), ``compile`` (compiled
    decoder layers), ``parts`` (compile the layers' parts instead, as under ``ac``), ours only; ``profile``
    (one more step under the profiler)."""
    parts = text.strip().split(":")
    if (
        len(parts) < 3
        or parts[0] not in ("full", "lora")
        or parts[1] not in ("ours", "bare")
        or not set(parts[3:]) <= {"ac", "compile", "parts", "profile"}
    ):
        raise SystemExit(
            f"bad --configs entry {text!r}: use weights:loop:attention[:ac], e.g. lora:ours:varlen:ac"
        )
    return parts[0], parts[1], parts[2], tuple(parts[3:])


def run_cuda(args: argparse.Namespace, shape: dict) -> None:
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if args.smoke:  # the code path on CPU with a small model (no flex: no CPU backward)
        shape = {
            **shape,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1024,
        }
    rows, repeats = (2, 2) if args.quick else (3, 3)
    row_tokens = 2048 if args.smoke else 16384
    samples = varied_samples(rows * row_tokens - row_tokens // 4, shape["vocab_size"], row_tokens)
    batches = make_batches(samples, row_tokens, 0)
    modes = ["dense", "varlen"] if device.type == "cpu" else ["dense", "flex", "varlen"]
    best = modes[1]
    configs = [(w, "ours", m, ()) for w in ("full", "lora") for m in modes] + [
        (w, "bare", best, ()) for w in ("full", "lora")
    ]
    if args.configs:  # weights:loop:attention[:ac][:compile], e.g. lora:ours:varlen:ac
        configs = [parse_config(c) for c in args.configs.split(",")]
    print(
        f"{len(batches)} rows, {sum(b.n_tokens for b in batches)} tokens, {len(samples)} samples; "
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"peak {args.peak_tflops} TFLOP/s",
        flush=True,
    )
    results = []
    for weights, loop, attention, flags in configs:
        r = run_config(
            shape, weights, loop, attention, batches, repeats, device, args.peak_tflops, flags, args.profile
        )
        results.append(r)
        print(
            f"  {weights:<5} {loop:<5} {r.path:<10} "
            + (
                r.error
                or f"{r.tokens_per_s:,.0f} tok/s  "
                f"MFU {r.mfu:.1%}  peak {r.peak_gib:.1f} GiB  step {r.step_s:.2f} s"
            ),
            flush=True,
        )
    print(f"\nsummary (best of {repeats} steps after a warm-up; load {os.getloadavg()[0]:.2f})")
    print(
        f"{'weights':<8} {'loop':<6} {'attention':<10} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs bare':>8}"
    )
    bare = {r.weights: r for r in results if r.loop == "bare" and not r.error}
    for r in results:
        if r.error:
            print(f"{r.weights:<8} {r.loop:<6} {r.path:<10} {r.error:>36}")
            continue
        ref = bare.get(r.weights)
        ratio = f"{r.tokens_per_s / ref.tokens_per_s:.2f}" if ref and r.loop == "ours" else ""
        print(
            f"{r.weights:<8} {r.loop:<6} {r.path:<10} {r.tokens_per_s:>10,.0f} {r.mfu:>7.1%} "
            f"{r.peak_gib:>9.1f} {ratio:>8}"
        )
    print("targets (#32.5, one H200): MFU >= 40% full weights; LoRA peak <= 24 GiB")
