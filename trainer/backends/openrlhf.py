"""The distributed backend: OpenRLHF's ``Actor`` + ``DeepspeedStrategy`` + ``PolicyLoss``.

The only module that imports OpenRLHF (lazily, from ``load``). It consumes the same packed
``Batch`` objects as the torch backend: ``openrlhf_batch`` unpacks them into OpenRLHF's layout
(one sample per row, prompt left-padded, response right-padded, ``action_mask`` over the last A
positions), which ``Actor`` re-packs itself with flash-attention varlen when
``packing_samples=True``. Our loss weights (per-rollout normalisation) are folded into the
advantages so OpenRLHF's token-level ``PolicyLoss`` computes exactly our weighted sum: the PPO-clip
loss is positively homogeneous in the advantage, so ``PolicyLoss(A * w * N)`` with a token mean
over N tokens equals ``sum(w * loss(A))`` (checked on CPU in tests/trainer/test_openrlhf_backend.py).

Ranks: ``tracerl train --backend openrlhf --nproc N`` starts N ranks with torchrun
(``trainer/launcher.py``); each calls ``OpenRLHFBackend.load`` under torchrun's ``RANK``/``LOCAL_RANK``/
``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, which ``DeepspeedStrategy.setup_distributed`` and
``deepspeed.init_distributed`` read. Each rank trains every ``world``-th micro-batch. DeepSpeed's ZeRO
reduction *averages* gradients over data-parallel ranks (``average_tensor`` in
deepspeed/runtime/zero/stage_1_and_2.py divides by the world size) while our weights sum to 1 over
the whole round, so each rank's loss is multiplied by ``world``; ranks with fewer micro-batches run a
zero-weighted extra one, so every rank makes the same number of backward calls (each one joins
ZeRO's gradient reduction). ``train_batch_size`` is ``world`` (micro-batch 1, accumulation 1), which
DeepSpeed's batch-size check requires.

Status: batch building, the loss mapping and the training loop are tested on CPU with OpenRLHF's
real ``Actor`` and ``PolicyLoss`` (the loop with ``FakeDeepspeedStrategy``, since DeepSpeed's
strategy needs CUDA). Under ``--nproc 2`` on CPU the launcher and worker are tested up to this
module's ``load``, which stops with its "needs CUDA GPUs" error in every rank
(tests/trainer/test_multirank.py). What has not run anywhere: ``OpenRLHFBackend.load`` (DeepSpeed
engine setup), the multi-rank step above (scaling, padding, ZeRO-2 reduction with several backward
calls per optimizer step) and ``save`` under DeepSpeed; nothing here has run on a GPU.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.backends.base import StepCallback, TrainMetrics
from trainer.config import TrainSettings
from trainer.dataset import Batch


def import_openrlhf() -> Any:
    """Import ``openrlhf.models``; on machines without flash-attn's CUDA extension, stub it first
    (the same trick as OpenRLHF's CPU tests: nothing on the paths we use calls into it)."""
    try:
        import flash_attn_2_cuda  # noqa: F401
    except ImportError:
        sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    try:
        import openrlhf.models as models
    except ImportError as e:
        raise ImportError(f"--backend openrlhf needs OpenRLHF ({e}); install the extra: pip install 'tracerl[openrlhf]'") \
            from e
    return models


@dataclass
class OpenRLHFBatch:
    """One sample per row, OpenRLHF's layout. ``[B, A]`` tensors cover the last A (response) positions."""

    sequences: torch.Tensor  # [B, P+A] long: left-padded prompt, right-padded response
    attention_mask: torch.Tensor  # [B, P+A] long
    action_mask: torch.Tensor  # [B, A] bool
    advantages: torch.Tensor  # [B, A]
    weights: torch.Tensor  # [B, A], our per-token loss weights
    rollout_log_probs: torch.Tensor  # [B, A], 0 where unknown
    has_rollout_log_probs: torch.Tensor  # [B, A] bool

    def weighted_advantages(self) -> torch.Tensor:
        """Advantages with the loss weights folded in, for a token-level ``PolicyLoss``."""
        n = self.action_mask.sum().clamp(min=1)
        return self.advantages * self.weights * n


def openrlhf_batch(batch: Batch, pad_id: int = 0) -> OpenRLHFBatch:
    """Unpack a packed ``Batch`` into one row per sample in OpenRLHF's left/right-padded layout."""
    pieces = []
    for i, spans in enumerate(batch.sample_spans):
        for start, end in spans:
            tokens = batch.input_ids[i, start:end]
            # per-token tensors are aligned with input_ids[:, 1:]: token t sits at index t-1
            w = batch.weights[i, max(start - 1, 0):end - 1]
            if start == 0:
                w = torch.cat([torch.zeros(1), w])
            resp = (w > 0).nonzero().flatten()
            p = int(resp[0]) if len(resp) else len(tokens)
            sl = slice(start + p - 1, end - 1)
            pieces.append((tokens[:p], tokens[p:], batch.advantages[i, sl], batch.weights[i, sl],
                           batch.rollout_logprobs[i, sl], batch.has_rollout_logprobs[i, sl]))
    P = max(len(x[0]) for x in pieces)
    A = max(len(x[1]) for x in pieces)
    B = len(pieces)
    seq = torch.full((B, P + A), pad_id, dtype=torch.long)
    att = torch.zeros((B, P + A), dtype=torch.long)
    act = torch.zeros((B, A), dtype=torch.bool)
    adv, wts, rlp = torch.zeros((B, A)), torch.zeros((B, A)), torch.zeros((B, A))
    has = torch.zeros((B, A), dtype=torch.bool)
    for b, (prompt, response, a, w, lp, h) in enumerate(pieces):
        p, n = len(prompt), len(response)
        seq[b, P - p:P] = prompt
        seq[b, P:P + n] = response
        att[b, P - p:P + n] = 1
        act[b, :n] = True
        adv[b, :n], wts[b, :n], rlp[b, :n], has[b, :n] = a, w, lp, h
    return OpenRLHFBatch(seq, att, act, adv, wts, rlp, has)


def policy_loss_module(settings: TrainSettings) -> Any:
    """OpenRLHF's ``PolicyLoss`` configured like our ``LossConfig`` (token-level: weights are in A)."""
    models = import_openrlhf()
    level = "off" if settings.is_correction == "off" else "token"
    return models.PolicyLoss(
        clip_eps_low=settings.clip_eps_low, clip_eps_high=settings.clip_eps_high, dual_clip=settings.dual_clip,
        token_level_loss=True, is_correction_level=level,
        is_correction_mode=settings.is_correction if level == "token" else "mask",
        is_correction_threshold=(settings.is_low, settings.is_high),
    )


class OpenRLHFBackend:
    """DeepSpeed-wrapped OpenRLHF ``Actor``; one process per GPU under the ``deepspeed`` launcher."""

    def __init__(self, actor: Any, strategy: Any, tokenizer: Any, settings: TrainSettings) -> None:
        self.actor = actor
        self.strategy = strategy
        self.tokenizer = tokenizer
        self.settings = settings
        self.adapter = settings.lora_rank > 0
        self.loss_fn = policy_loss_module(settings)

    @classmethod
    def load(cls, settings: TrainSettings, base_model: Path, parent: Path | None) -> OpenRLHFBackend:
        if not torch.cuda.is_available():
            raise RuntimeError("--backend openrlhf needs CUDA GPUs (DeepSpeed); use --backend torch on CPU")
        models = import_openrlhf()
        from types import SimpleNamespace

        from openrlhf.utils.deepspeed import DeepspeedStrategy
        from transformers import AutoTokenizer

        # the attributes DeepspeedStrategy 0.11.2 reads from its args (openrlhf/utils/deepspeed/deepspeed.py)
        args = SimpleNamespace(
            local_rank=-1, optim="adam",
            ds=SimpleNamespace(param_dtype="bf16" if settings.bf16 else "fp32", zero_stage=2, adam_offload=False,
                               tensor_parallel_size=1, ring_attn_size=1),
            train=SimpleNamespace(dynamic_batch_enable=False),
        )
        world = int(os.environ.get("WORLD_SIZE", "1"))  # DeepSpeed checks batch == micro * accum * world
        strategy = DeepspeedStrategy(seed=settings.seed, max_norm=settings.max_grad_norm, zero_stage=2,
                                     args=args, micro_train_batch_size=1, train_batch_size=world)
        strategy.setup_distributed()
        actor = models.Actor(str(parent or base_model), attn_implementation="flash_attention_2",
                             param_dtype=args.ds.param_dtype, lora_rank=settings.lora_rank,
                             lora_alpha=int(settings.lora_alpha), packing_samples=True)
        cfg = {"optim": "adam", "adam": {"lr": settings.lr, "betas": (0.9, 0.999), "eps": 1e-8,
                                         "weight_decay": settings.weight_decay},
               "lr_scheduler": "constant", "lr_warmup_ratio": 0.0, "min_lr_ratio": 1.0,
               "max_norm": settings.max_grad_norm, "scheduler_steps": 1}
        actor, _, _ = strategy.prepare((actor, cfg))
        return cls(actor, strategy, AutoTokenizer.from_pretrained(base_model), settings)

    def train(self, batches: Sequence[Batch], on_step: StepCallback | None = None) -> TrainMetrics:
        """One optimizer step per epoch over all micro-batches (as the torch backend with one step per
        epoch); with several epochs the old logprobs are computed once, before any update. Under N
        ranks, this rank's share and the loss scaling are as in the module docstring."""
        import time

        from trainer.distributed import rank_world, reduce_metrics

        t0 = time.perf_counter()
        rank, world = rank_world()
        pad = self.tokenizer.pad_token_id or 0
        dev = next(self.actor.parameters()).device
        mine = batches[rank::world]
        n_calls = -(-len(batches) // world)  # ceil: every rank makes this many backward calls
        # (batch, loss scale): ours scaled by world against ZeRO's mean; padding calls count zero
        work = [(b, float(world)) for b in mine] + [(batches[0], 0.0)] * (n_calls - len(mine))
        obs = [openrlhf_batch(b, pad) for b, _ in work]
        n_tok = sum(b.n_tokens for b in mine)

        def forward(ob: OpenRLHFBatch) -> torch.Tensor:
            return self.actor(ob.sequences.to(dev), action_mask=ob.action_mask.to(dev),
                              attention_mask=ob.attention_mask.to(dev))

        old: list[torch.Tensor] | None = None
        if self.settings.epochs > 1:
            with torch.no_grad():
                old = [forward(ob).detach() for ob in obs]
        m = TrainMetrics()
        for _epoch in range(self.settings.epochs):
            for i, (ob, (_, scale)) in enumerate(zip(obs, work, strict=True)):
                act = ob.action_mask.to(dev)
                logp = forward(ob)
                old_lp = old[i] if old is not None else logp.detach()
                rollout = torch.where(ob.has_rollout_log_probs.to(dev), ob.rollout_log_probs.to(dev), old_lp)
                # weights folded into A: PolicyLoss's token mean over this micro-batch = our weighted sum
                loss, clip, ppo_kl, _, _ = self.loss_fn(logp, old_lp, ob.weighted_advantages().to(dev),
                                                        action_mask=act.float(), rollout_log_probs=rollout)
                self.strategy.backward(loss * scale if scale != 1.0 else loss, self.actor, None)
                if scale == 0.0:
                    continue
                m.loss += float(loss) / self.settings.epochs
                m.clip_fraction += float(clip) / (len(batches) * self.settings.epochs)
                m.ppo_kl += float(ppo_kl) / (len(batches) * self.settings.epochs)
                m.micro_batches += 1
            self.strategy.optimizer_step(None, self.actor, None)
            m.optimizer_steps += 1
            m.tokens += n_tok
            if on_step is not None:
                on_step(m.optimizer_steps, m)
        m.seconds = time.perf_counter() - t0
        if world > 1:
            m, _ = reduce_metrics(m, 0.0, dev)
        m.policy_loss = m.loss
        return m

    def save(self, out_dir: Path) -> None:
        self.strategy.save_model(self.actor, self.tokenizer, str(out_dir))
