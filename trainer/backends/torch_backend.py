"""The default backend: plain torch, CPU or GPU, full fine-tune or LoRA; one process, or one per rank.

One round = ``epochs`` passes, each split into ``steps_per_epoch`` optimizer steps over the
round's packed micro-batches (gradient accumulation inside a step). With a single step per round
the data is exactly on-policy, so the "old" logprobs are the current ones, detached, and no extra
forward pass is spent; with more steps they are computed once up front, before any update, and
PPO's clipping does its job. KL to the base model (``kl_coef > 0``) uses the base weights: the
LoRA model with its adapter switched off, or a frozen copy for full fine-tuning.

Under ``tracerl train --nproc N`` (``trainer/launcher.py``) each rank runs this same loop on its
share of every step's micro-batches and the gradients are summed across ranks before clipping
(``trainer.distributed``), so N ranks take the same step as one process.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from store.atomic import fsync_dir, fsync_file
from trainer.attention import resolve as resolve_attention
from trainer.attention import use_attention
from trainer.backends.base import StepCallback, TrainMetrics
from trainer.backends.policy_model import load_policy, pick_device
from trainer.checkpoint import save_weights
from trainer.config import TrainSettings
from trainer.cpu_memory import keep_freed_memory
from trainer.distributed import all_reduce_grads, broadcast_trainable, finish_metrics, rank_world, step_plan
from trainer.loss import ImportanceStats, LossConfig, policy_loss
from trainer.merge import copy_tokenizer_files
from trainer.packing import Batch, sequence_logprobs

OPTIMIZER_FILE = "optimizer.pt"
MASTER_DIR = "master"  # fp32 weights to resume from, when the served ones are bf16


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower."""
    cpu = torch.cpu
    return any(
        getattr(cpu, probe, lambda: False)()
        for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def autocast_dtype(device: torch.device, bf16: bool) -> torch.dtype | None:
    """bf16 autocast where it is native (CUDA, bf16 CPUs: a 135M LoRA step took 11 s instead of 18 s), else None."""
    if bf16 and (device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())):
        return torch.bfloat16
    return None


def served_dtype(device: torch.device, bf16: bool) -> torch.dtype | None:
    """The precision full weights are written in for the engine: bf16 when a GPU trains under bf16
    autocast (vLLM serves bf16 there, and it halves the bytes a round writes), else as held (None).
    CPUs keep fp32 even under bf16 autocast: the CPU engine serves fp32 (the demo), and a bf16 copy
    would serve a coarsely rounded policy (``trainer/merge.py``)."""
    return torch.bfloat16 if device.type == "cuda" and autocast_dtype(device, bf16) is not None else None


def checkpoint_activations(model: Any) -> None:
    """Recompute each decoder layer in the backward pass (non-reentrant ``torch.utils.checkpoint``: no
    input needs ``requires_grad``, so a LoRA model with frozen embeddings works as is). transformers 5.23
    names it ``activation_checkpointing_enable``; older 5.x, ``gradient_checkpointing_enable``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(base).__name__} does not support activation checkpointing; "
            "train without --activation-checkpointing"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_blocks(model: Any, whole_layers: bool = True) -> int:
    """``torch.compile`` (dynamic shapes) the model's decoder blocks in place; returns how many modules.

    Why: around the matmuls a decoder layer is a chain of elementwise ops (RMSNorm's upcast, square,
    mean, rsqrt, scale; rotary embeddings; SwiGLU; residual adds; autocast's casts) that run one kernel
    each in eager mode, forward and backward; on one H200 they took as long as the matmuls of a 1.5B model
    (``bench/attention_memory.py --profile``).

    ``whole_layers``: each decoder layer is one graph, all of the above fused. The attention kernel stays
    eager behind a graph break, and the packed layout it reads is an object dynamo does not guard on
    (``trainer.attention.SegmentLayout``), so one graph serves every packed layout. Without it (what
    ``--activation-checkpointing`` needs: a graph break inside a checkpointed layer would run the layer
    eagerly) the norms and MLPs compile one by one, and the attention modules around their kernel too
    (not under flex, whose block mask dynamo would guard on)."""
    from trainer.attention import FLEX_IMPL

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flex = getattr(base.config, "_attn_implementation", None) == FLEX_IMPL
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    n = 0
    if whole_layers and layers and not flex:
        for layer in layers:
            layer.compile(dynamic=True)
            n += 1
        parts: tuple[str, ...] = ("Norm",)  # the final norm, outside the layers
        inner = {id(sub) for layer in layers for sub in layer.modules()}
        modules = [m for m in model.modules() if id(m) not in inner]
    else:
        parts = ("RMSNorm", "MLP") if flex else ("RMSNorm", "MLP", "Attention")
        modules = list(model.modules())
    for module in modules:
        if type(module).__name__.endswith(parts):
            module.compile(dynamic=True)
            n += 1
    return n


def _set_threads(n: int) -> None:
    if n > 0 and n != torch.get_num_threads():
        torch.set_num_threads(n)


def _add_micro_batch(m: TrainMetrics, out: Any, n_resp: float, steps: int, tokens: int) -> None:
    """One micro-batch's loss terms into the round's metrics: losses averaged over the round's ``steps``,
    the per-token ratios weighted by its response tokens (``finish_metrics`` divides them)."""
    m.loss += out.loss.item() / steps
    m.policy_loss += out.policy_loss.item() / steps
    m.kl += out.kl.item() / steps
    m.clip_fraction += out.clip_fraction.item() * n_resp
    m.ppo_kl += out.ppo_kl.item() * n_resp
    m.is_filtered_fraction += out.is_filtered_fraction.item() * n_resp
    m.micro_batches += 1
    m.tokens += tokens


def loss_config(s: TrainSettings) -> LossConfig:
    return LossConfig(
        clip_eps_low=s.clip_eps_low,
        clip_eps_high=s.clip_eps_high,
        dual_clip=s.dual_clip,
        kl_coef=s.kl_coef,
        kl_estimator=s.kl_estimator,
        is_correction=s.is_correction,
        is_threshold_low=s.is_low,
        is_threshold_high=s.is_high,
    )


class TorchBackend:
    """Owns the model, its optimizer and (when needed) the reference; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer_dir: Path | None,
        settings: TrainSettings,
        device: torch.device,
        ref_model: Any | None = None,
    ) -> None:
        self.model = model
        self.tokenizer_dir = tokenizer_dir  # the base model: its tokenizer files go into each checkpoint
        self.settings = settings
        self.device = device
        self.ref_model = ref_model
        self.adapter = hasattr(model, "peft_config")
        self.rank, self.world = rank_world()
        self.loss_config = loss_config(settings)
        params = [p for p in model.parameters() if p.requires_grad]
        # CUDA: one fused kernel for the whole update (foreach launches one per op per parameter group)
        fused = {"fused": True} if params and all(p.is_cuda for p in params) else {}
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, **fused)
        self.served_dtype = served_dtype(device, settings.bf16)
        self.defer_resume_state = False

    @classmethod
    def load(cls, settings: TrainSettings, base_model: Path, parent: Path | None) -> TorchBackend:
        """Policy = base model (round 0) or the previous round's checkpoint, with its optimizer state."""
        device = pick_device(settings.device)
        if device.type == "cpu":
            keep_freed_memory()  # each micro-batch reuses the last one's memory, not fresh pages
            if settings.threads:
                torch.set_num_threads(settings.threads)
        model, ref = load_policy(settings, base_model, parent)
        mode = resolve_attention(settings.attention, device)
        use_attention(model, mode)
        if ref is not None:
            use_attention(ref, mode)
            ref.to(device)
        if settings.activation_checkpointing:
            checkpoint_activations(model)
        if settings.compile_blocks:
            compile_blocks(model, whole_layers=not settings.activation_checkpointing)
        model.to(device).train()
        if rank_world()[1] > 1:
            broadcast_trainable(model)
        backend = cls(model, Path(base_model), settings, device, ref)
        if parent is not None and (parent / OPTIMIZER_FILE).exists():
            backend.load_optimizer(parent / OPTIMIZER_FILE)
        return backend

    def renew(self, settings: TrainSettings) -> None:
        """Continue with this model and optimizer in another round (``trainer/kept_model.py``): as ``load``
        would leave them from the checkpoint they were saved as, with this round's threads and seed."""
        self.settings = settings
        if self.device.type == "cpu" and settings.threads:
            torch.set_num_threads(settings.threads)
        torch.manual_seed(settings.seed)

    def load_optimizer(self, path: Path) -> None:
        """Carry AdamW moments across rounds; the learning rate comes from the current settings."""
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:
            group["lr"] = self.settings.lr
            group["weight_decay"] = self.settings.weight_decay

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = autocast_dtype(self.device, self.settings.bf16)
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    @torch.no_grad()
    def _ref_logprobs(self, batch: Batch) -> torch.Tensor:
        with self._autocast():
            if self.ref_model is not None:
                return sequence_logprobs(self.ref_model, batch, batch.weights > 0)
            with self.model.disable_adapter():
                return sequence_logprobs(self.model, batch, batch.weights > 0)

    @torch.no_grad()
    def _logprobs_no_grad(self, batch: Batch) -> torch.Tensor:
        with self._autocast():
            return sequence_logprobs(self.model, batch, batch.weights > 0)

    def train(
        self,
        batches: Sequence[Batch],
        on_step: StepCallback | None = None,
        threads_now: Callable[[], int] | None = None,
    ) -> TrainMetrics:
        """Every rank gets all of the round's ``batches`` and trains its share of each step (one rank:
        all of them); see ``trainer.distributed`` for why the ranks' gradients are summed.
        ``threads_now``: torch threads for the next micro-batch on CPU (``run_once``'s hook)."""
        s = self.settings
        t0 = time.perf_counter()
        plan = step_plan(len(batches), s.steps_per_epoch, self.rank, self.world)
        # each step's weight total over all ranks: every rank's loss terms are shares of the same sum
        step_weight = [
            float(sum(batches[i].weights.sum().item() for i in idx))
            for idx in step_plan(len(batches), s.steps_per_epoch)
        ]
        local = {i: batches[i].to(self.device) for step in plan for i in step}
        n_steps = len(plan)
        off_policy = s.epochs * n_steps > 1
        old = {i: self._logprobs_no_grad(b) for i, b in local.items()} if off_policy else None
        ref = {i: self._ref_logprobs(b) for i, b in local.items()} if s.kl_coef > 0 else None
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        m = TrainMetrics()
        iw = ImportanceStats()
        resp_tokens = 0.0
        progress = _progress(s.progress, s.epochs * len(local), "train")
        for _epoch in range(s.epochs):
            for step, total_w in zip(plan, step_weight, strict=True):
                if total_w <= 0:
                    continue
                for i in step:
                    b = local[i]
                    if threads_now is not None and self.device.type == "cpu":
                        _set_threads(threads_now())
                    old_lp = old[i] if old is not None else None
                    out = self._micro_batch(b, old_lp, ref[i] if ref is not None else None, total_w, iw)
                    n_resp = float((b.weights > 0).sum().item())
                    resp_tokens += n_resp
                    _add_micro_batch(m, out, n_resp, s.epochs * n_steps, b.n_tokens)
                    progress.update(1)
                m.grad_norm = self._optimizer_step(params)
                m.optimizer_steps += 1
                if on_step is not None:
                    on_step(m.optimizer_steps, m)
        progress.close()
        m.seconds = time.perf_counter() - t0
        iw.into(m)
        return finish_metrics(m, resp_tokens, self.device, self.world)

    def _micro_batch(
        self,
        b: Batch,
        old_lp: torch.Tensor | None,
        ref_lp: torch.Tensor | None,
        total_w: float,
        iw: ImportanceStats,
    ) -> Any:
        """Forward, loss and backward of one micro-batch (its gradients accumulate); the loss terms.
        ``old_lp`` None: on-policy, pi_old is this forward's own logprobs, detached."""
        with self._autocast():
            lp = sequence_logprobs(self.model, b, b.weights > 0)
        old_lp = old_lp if old_lp is not None else lp.detach()
        rollout = None
        if b.has_rollout_logprobs.any():
            rollout = torch.where(b.has_rollout_logprobs, b.rollout_logprobs, old_lp)
            iw.add(old_lp, b.rollout_logprobs, b.has_rollout_logprobs & (b.weights > 0))
        out = policy_loss(
            lp,
            old_lp,
            b.advantages,
            b.weights / total_w,
            self.loss_config,
            rollout_logprobs=rollout,
            ref_logprobs=ref_lp,
        )
        out.loss.backward()
        return out

    def _optimizer_step(self, params: list[torch.Tensor]) -> float:
        """The ranks' gradients summed, clipped to ``max_grad_norm`` (0: not clipped), one optimizer
        step; the gradient norm before clipping."""
        if self.world > 1:
            all_reduce_grads(params)
        if self.settings.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm)
        else:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, out_dir: Path) -> None:
        """Called on every rank (like DeepSpeed's ``save_model``); the replicas are equal, rank 0 writes.

        What the engine loads: full weights as one safetensors file in ``served_dtype`` (bf16 when
        training in bf16: half the bytes, and what vLLM serves), or the LoRA adapter; plus the
        tokenizer. The resume state follows here, or later with ``write_resume_state`` when
        ``defer_resume_state`` is set (``run_once`` writes it beside the publish)."""
        if self.rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.adapter:
            self.model.save_pretrained(out_dir)
        else:
            self._save_full(out_dir, self.served_dtype)
        if self.tokenizer_dir is not None and not copy_tokenizer_files(self.tokenizer_dir, out_dir):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(self.tokenizer_dir).save_pretrained(out_dir)
        if not self.defer_resume_state:
            self.write_resume_state(out_dir)

    def _save_full(self, out_dir: Path, dtype: torch.dtype | None) -> None:
        model = self.model
        save_weights(model.state_dict(), out_dir / "model.safetensors", dtype)
        config = copy.deepcopy(model.config)
        config.dtype = dtype or next(model.parameters()).dtype  # what the file holds, as save_pretrained says
        config.save_pretrained(out_dir)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out_dir)

    def write_resume_state(self, checkpoint: Path) -> None:
        """What only the next round reads: ``master/`` (the fp32 weights, when the served ones are in a
        lower precision; ``load_policy`` prefers them) and then ``optimizer.pt``. Each appears by rename,
        so a kill midway leaves a checkpoint without it: the next round then starts from the served
        weights and fresh Adam moments, instead of from half a file."""
        if self.rank != 0:
            return
        model_dtype = next(self.model.parameters()).dtype
        if not self.adapter and self.served_dtype is not None and self.served_dtype != model_dtype:
            tmp = checkpoint / f".{MASTER_DIR}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            self._save_full(tmp, None)
            _fsync_files(tmp)
            os.replace(tmp, checkpoint / MASTER_DIR)
        tmp_file = checkpoint / f".{OPTIMIZER_FILE}.tmp"
        torch.save(self.optimizer.state_dict(), tmp_file)
        _fsync_files(tmp_file)
        os.replace(tmp_file, checkpoint / OPTIMIZER_FILE)
        fsync_dir(checkpoint)


def _fsync_files(path: Path) -> None:
    """Flush a file, or a directory's files, to disk before the rename that makes them visible."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fsync_file(f)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool, total: int, desc: str) -> Any:
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="mb", leave=False)
