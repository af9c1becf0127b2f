"""Data parallelism for the torch backend: which rank trains which micro-batch, and how ranks agree.

A round's optimizer step ``j`` covers the micro-batches ``batches[j::n_steps]`` (interleaved, so
steps have similar sizes); under ``nproc`` ranks each rank takes every ``world``-th micro-batch of
each step (``step_plan``). The loss weights of a step are normalised by the step's *global* weight
total (every rank reads all batches' weights, see ``TorchBackend.train``), so the step's loss is a
plain sum over micro-batches, wherever they run. Gradients therefore add across ranks: a
``SUM`` all-reduce (not DDP's mean, which would divide by ``world``) gives every rank exactly the
gradient of one process accumulating all micro-batches, up to the order of float additions.
Clipping and AdamW then run on identical gradients on every rank, so the replicas stay equal
without broadcasting weights after each step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from trainer.backends.base import TrainMetrics


def rank_world() -> tuple[int, int]:
    """This process's rank and the number of ranks; (0, 1) when no process group is set up."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def step_plan(n_batches: int, steps_per_epoch: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """Indices of the micro-batches ``rank`` trains in each optimizer step of one epoch.

    Steps are ``range(j, n, n_steps)`` (as in one process); inside a step, ranks take every
    ``world``-th index, so the union over ranks is exactly the single-process step and no
    micro-batch runs twice. A rank may get none in a step (fewer micro-batches than ranks).
    """
    n_steps = max(1, min(steps_per_epoch, n_batches))
    return [list(range(j, n_batches, n_steps))[rank::world] for j in range(n_steps)]


def broadcast_trainable(model: torch.nn.Module) -> None:
    """Start every rank from rank 0's trainable weights. Ranks load the same files with the same seed,
    so this only guards against a source of randomness in initialisation (a fresh LoRA adapter) that
    the seed does not cover; a silent divergence here would never be noticed otherwise."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.requires_grad:
            dist.broadcast(p.data, src=0)


def all_reduce_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum gradients over ranks. A parameter that got no gradient on any rank stays ``None`` (as in
    one process, where AdamW skips it); one that got it on some rank is zero-filled on the others."""
    import torch.distributed as dist

    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    works = []
    for p, flag in zip(params, has.tolist(), strict=True):
        if not flag:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        works.append(dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True))
    for w in works:
        w.wait()


SUMMED = ("loss", "policy_loss", "kl", "clip_fraction", "ppo_kl", "is_filtered_fraction", "micro_batches",
          "tokens", "is_tokens", "is_weight_mean")


def reduce_metrics(m: TrainMetrics, resp_tokens: float, device: torch.device) -> tuple[TrainMetrics, float]:
    """Add up the ranks' running metrics, taken before the token-level means are divided out (losses are
    sums of weighted micro-batch terms; clip/ppo-kl/filtered are token-weighted sums), and the response
    token counts; ``seconds`` becomes the slowest rank's. ``grad_norm`` and ``optimizer_steps`` are
    already equal on every rank."""
    import torch.distributed as dist

    values = [float(getattr(m, k)) for k in SUMMED] + [resp_tokens]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    slowest = torch.tensor([m.seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    extremes = torch.tensor([m.is_weight_max, -m.is_weight_min if m.is_tokens else -math.inf],
                            dtype=torch.float64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    *sums, tokens = t.tolist()
    hi, neg_lo = extremes.tolist()
    out = dataclasses.replace(m, seconds=float(slowest.item()), is_weight_max=hi,
                              is_weight_min=-neg_lo if math.isfinite(neg_lo) else 0.0)
    for k, v in zip(SUMMED, sums, strict=True):
        setattr(out, k, round(v) if isinstance(getattr(m, k), int) else v)
    return out, tokens


def finish_metrics(m: TrainMetrics, resp_tokens: float, device: torch.device, world: int) -> TrainMetrics:
    """A backend's round metrics as reported: summed over ranks (``reduce_metrics``), the token-weighted
    sums divided by the response tokens, and a NaN/inf loss refused (the round fails and is retried
    instead of publishing a diverged policy)."""
    if world > 1:
        m, resp_tokens = reduce_metrics(m, resp_tokens, device)
    if resp_tokens:
        m.clip_fraction /= resp_tokens
        m.ppo_kl /= resp_tokens
        m.is_filtered_fraction /= resp_tokens
    if m.is_tokens:
        m.is_weight_mean /= m.is_tokens
    if not math.isfinite(m.loss):
        raise FloatingPointError(f"training loss is {m.loss}; lower --lr or check the rewards for NaN/inf")
    return m
