"""The distributed backend: OpenRLHF's ``Actor`` + ``DeepspeedStrategy`` + ``PolicyLoss`` on DeepSpeed.

The only module that imports OpenRLHF (lazily, from ``load``). It always runs inside torchrun ranks
(``trainer/launcher.py``, also for ``--nproc 1``), so DeepSpeed's process state never lives in the
``tracerl train`` process. It consumes the same packed ``Batch`` objects as the torch backend:
``openrlhf_batch`` unpacks them into OpenRLHF's layout (one sample per row, prompt left-padded,
response right-padded, ``action_mask`` over the last A positions), which ``Actor`` re-packs itself
(``packing_samples=True``: flash-attention varlen on GPU, sdpa on CPU, which transformers splits on
``position_ids``). The policy is loaded by ``policy_model.load_policy`` (as the torch backend does)
and wrapped in ``Actor``, so fp32, LoRA adapters from an earlier round and ``--lora-targets`` work.

One optimizer step per ``step_plan`` step, as in the torch backend: step j trains the same
micro-batches, each rank its share. Before every backward the engine is told whether it is the
step's last (``set_gradient_accumulation_boundary``): tracerl runs DeepSpeed with micro-batch 1 and
accumulation 1, so without it every backward is a boundary and ZeRO-2 keeps only the last
micro-batch's gradient. The loss weights of a step are normalised by the step's global weight total
and passed through ``PolicyLoss``'s own DP-invariant token reduction: advantages ``A * w / W * N``
with ``batch_num_tokens=N`` (the step's response tokens over all ranks) and ``dp_size=world``, which
undoes ZeRO's gradient *mean* over ranks (``average_tensor`` in deepspeed/runtime/zero/
stage_1_and_2.py); with ``--aggregation token`` that is exactly OpenRLHF's token-level loss. A rank
with fewer micro-batches in a step runs zero-weighted extra ones: ZeRO-2 reduces gradients in every
backward, so every rank must make the same number. The KL to the base (``--kl-coef``) is OpenRLHF's
``compute_approx_kl`` with the same weights; the Adam state goes into ``optimizer.pt`` in the torch
backend's format (``zero_optimizer.py``) and comes back next round; grad_norm is DeepSpeed's global
norm before clipping.

CPU ranks (``--device cpu``, or ``auto`` without CUDA): DeepSpeed's CPU accelerator and gloo, fp32,
sdpa, ``torch.optim.AdamW`` (``"torch_adam": true``) and no compiled op; see ``cpu_strategy``. On GPU
OpenRLHF's strategy runs unchanged: bf16 (``--no-bf16``: fp32), flash-attention 2, FusedAdam, nccl.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.backends.base import StepCallback, TrainMetrics
from trainer.backends.policy_model import load_policy, pick_device
from trainer.backends.torch_backend import OPTIMIZER_FILE
from trainer.config import TrainSettings
from trainer.distributed import finish_metrics, rank_world, step_plan
from trainer.loss import ImportanceStats
from trainer.packing import Batch


def import_openrlhf() -> Any:
    """Import ``openrlhf.models``; on machines without flash-attn's CUDA extension, register an empty
    one first (as OpenRLHF's own CPU tests do; nothing on the paths we use calls into it)."""
    try:
        import flash_attn_2_cuda  # noqa: F401
    except ImportError:
        sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    try:
        import openrlhf.models as models
    except ImportError as e:
        raise ImportError(
            f"--backend openrlhf needs OpenRLHF ({e}); install the extra: pip install 'tracerl[openrlhf]'"
        ) from e
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

    def folded_advantages(self, step_weight: float, step_tokens: float) -> torch.Tensor:
        """Advantages with the loss weights folded in, for ``PolicyLoss(batch_num_tokens=step_tokens)``:
        its masked sum over ``step_tokens`` then equals our weighted sum (PPO-clip is positively
        homogeneous in the advantage)."""
        return self.advantages * self.weights * (step_tokens / step_weight)

    def to(self, device: torch.device) -> OpenRLHFBatch:
        return OpenRLHFBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def openrlhf_batch(batch: Batch, pad_id: int = 0) -> OpenRLHFBatch:
    """Unpack a packed ``Batch`` into one row per sample in OpenRLHF's left/right-padded layout."""
    if batch.shares_prefixes:
        raise ValueError("OpenRLHF trains one sample per row: build its batches without share_prefix")
    pieces = []
    for i, spans in enumerate(batch.sample_spans):
        for start, end in spans:
            tokens = batch.input_ids[i, start:end]
            # per-token tensors are aligned with input_ids[:, 1:]: token t sits at index t-1
            w = batch.weights[i, max(start - 1, 0) : end - 1]
            if start == 0:
                w = torch.cat([torch.zeros(1), w])
            resp = (w > 0).nonzero().flatten()
            p = int(resp[0]) if len(resp) else len(tokens)
            sl = slice(start + p - 1, end - 1)
            pieces.append(
                (
                    tokens[:p],
                    tokens[p:],
                    batch.advantages[i, sl],
                    batch.weights[i, sl],
                    batch.rollout_logprobs[i, sl],
                    batch.has_rollout_logprobs[i, sl],
                )
            )
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
        seq[b, P - p : P] = prompt
        seq[b, P : P + n] = response
        att[b, P - p : P + n] = 1
        act[b, :n] = True
        adv[b, :n], wts[b, :n], rlp[b, :n], has[b, :n] = a, w, lp, h
    return OpenRLHFBatch(seq, att, act, adv, wts, rlp, has)


def policy_loss_module(settings: TrainSettings) -> Any:
    """OpenRLHF's ``PolicyLoss`` configured like our ``LossConfig`` (token-level: weights are in A)."""
    models = import_openrlhf()
    level = "off" if settings.is_correction == "off" else "token"
    return models.PolicyLoss(
        clip_eps_low=settings.clip_eps_low,
        clip_eps_high=settings.clip_eps_high,
        dual_clip=settings.dual_clip,
        token_level_loss=True,
        is_correction_level=level,
        is_correction_mode=settings.is_correction if level == "token" else "mask",
        is_correction_threshold=(settings.is_low, settings.is_high),
    )


def cpu_strategy(strategy_class: type) -> type:
    """OpenRLHF 0.11.2's ``DeepspeedStrategy`` for CPU ranks: its own code throughout, except for
    what it would do with CUDA, each replaced only for the duration of the one call that needs it:

    - ``setup_distributed``: ``torch.cuda.set_device(LOCAL_RANK)`` does nothing (DeepSpeed's CPU
      accelerator has no devices); ``init_device_mesh("cuda", ...)`` builds the same mesh on "cpu";
      DeepSpeed's table of compatible ops (``deepspeed.ops.__compatible_ops__``) says no to its shm
      all-reduce (``deepspeed_shm_comm``, used by DeepSpeed inference only), which
      ``deepspeed.init_distributed`` would otherwise compile (minutes of C++);
    - ``save_model``: ``torch.cuda.synchronize()`` after its barrier does nothing;

    and one setting: ``"torch_adam": true`` in the optimizer params, so DeepSpeed steps with
    ``torch.optim.AdamW`` instead of compiling its CPU Adam. No other global is touched.
    """
    from unittest import mock

    import deepspeed.ops
    from openrlhf.utils.deepspeed import deepspeed as strategy_module
    from torch.distributed.device_mesh import init_device_mesh

    def no_op(*args: Any, **kwargs: Any) -> None:
        return None

    def cpu_mesh(_device: str, *args: Any, **kwargs: Any) -> Any:
        return init_device_mesh("cpu", *args, **kwargs)

    class CPUDeepspeedStrategy(strategy_class):  # type: ignore[misc, valid-type]
        def setup_distributed(self, *args: Any, **kwargs: Any) -> None:
            with contextlib.ExitStack() as stack:
                stack.enter_context(mock.patch.object(torch.cuda, "set_device", no_op))
                stack.enter_context(mock.patch.object(strategy_module, "init_device_mesh", cpu_mesh))
                stack.enter_context(
                    mock.patch.dict(deepspeed.ops.__compatible_ops__, {"deepspeed_shm_comm": False})
                )
                super().setup_distributed(*args, **kwargs)

        def get_ds_train_config(self, *args: Any, **kwargs: Any) -> dict:
            config = super().get_ds_train_config(*args, **kwargs)
            if "optimizer" in config:
                config["optimizer"]["params"]["torch_adam"] = True
            return config

        def save_model(self, *args: Any, **kwargs: Any) -> None:
            with mock.patch.object(torch.cuda, "synchronize", no_op):
                super().save_model(*args, **kwargs)

    return CPUDeepspeedStrategy


def deepspeed_strategy(settings: TrainSettings, cpu: bool, dtype: str) -> Any:
    """OpenRLHF's ``DeepspeedStrategy`` for this rank (ZeRO-2, one sample per micro-batch, one step per rank's
    batch), its process group set up; on CPU the gloo variant (``cpu_strategy``)."""
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    # the attributes DeepspeedStrategy 0.11.2 reads from its args (openrlhf/utils/deepspeed/deepspeed.py)
    args = types.SimpleNamespace(
        local_rank=-1,
        optim="adam",
        ds=types.SimpleNamespace(
            param_dtype=dtype, zero_stage=2, adam_offload=False, tensor_parallel_size=1, ring_attn_size=1
        ),
        train=types.SimpleNamespace(dynamic_batch_enable=False),
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))  # DeepSpeed checks batch == micro * accum * world
    strategy_class = cpu_strategy(DeepspeedStrategy) if cpu else DeepspeedStrategy
    strategy = strategy_class(
        seed=settings.seed,
        max_norm=settings.max_grad_norm,
        zero_stage=2,
        args=args,
        micro_train_batch_size=1,
        train_batch_size=world,
    )
    strategy.setup_distributed()
    return strategy


def optimizer_config(settings: TrainSettings) -> dict[str, Any]:
    """The optimizer and schedule ``strategy.prepare`` builds: Adam at a constant ``--lr``, clipped at ``--max-grad-norm``."""
    return {
        "optim": "adam",
        "adam": {
            "lr": settings.lr,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": settings.weight_decay,
        },
        "lr_scheduler": "constant",
        "lr_warmup_ratio": 0.0,
        "min_lr_ratio": 1.0,
        "max_norm": settings.max_grad_norm,
        "scheduler_steps": 1,
    }


@dataclass
class _RoundInputs:
    """What every micro-batch of a round reads (``OpenRLHFBackend._round_inputs``)."""

    steps: list[list[int]]  # the batches of each optimizer step, over all ranks
    obs: dict[int, Any]  # batch index -> OpenRLHFBatch on the device
    old: dict[int, torch.Tensor]  # pi_old of this rank's batches (empty: on-policy, the live logprobs are)
    ref: dict[int, torch.Tensor]  # the reference model's logprobs (empty without KL)
    step_weight: list[float]
    step_tokens: list[float]
    world: int
    share: float  # one step's share of the round's mean losses


class OpenRLHFBackend:
    """DeepSpeed-wrapped OpenRLHF ``Actor`` in one torchrun rank; see the module docstring."""

    def __init__(
        self,
        actor: Any,
        strategy: Any,
        tokenizer: Any,
        settings: TrainSettings,
        device: torch.device,
        ref: Any | None = None,
    ) -> None:
        self.actor = actor
        self.strategy = strategy
        self.tokenizer = tokenizer
        self.settings = settings
        self.device = device
        self.ref = ref  # a frozen base-model Actor (full fine-tuning with KL), else None
        self.adapter = settings.lora_rank > 0 or hasattr(self.engine.module, "peft_config")
        self.loss_fn = policy_loss_module(settings)

    @property
    def engine(self) -> Any:
        return self.actor.model  # the DeepSpeedEngine that ``strategy.prepare`` put in place

    @classmethod
    def load(cls, settings: TrainSettings, base_model: Path, parent: Path | None) -> OpenRLHFBackend:
        if "LOCAL_RANK" not in os.environ:
            raise RuntimeError(
                "OpenRLHFBackend.load runs in a torchrun rank (tracerl train starts them, "
                "trainer/launcher.py); DeepSpeed reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR "
                "and MASTER_PORT from there"
            )
        models = import_openrlhf()
        from transformers import AutoTokenizer

        cpu = pick_device(settings.device).type == "cpu"
        dtype = "bf16" if settings.bf16 and not cpu else "fp32"
        strategy = deepspeed_strategy(settings, cpu, dtype)
        device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        model, ref_model = load_policy(
            settings,
            base_model,
            parent,
            dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
            attn_implementation="sdpa" if cpu else "flash_attention_2",
        )
        actor = _actor(models, model)
        ref = _actor(models, ref_model).to(device) if ref_model is not None else None
        actor, _, _ = strategy.prepare((actor, optimizer_config(settings)))
        backend = cls(actor, strategy, AutoTokenizer.from_pretrained(base_model), settings, device, ref)
        if parent is not None and (parent / OPTIMIZER_FILE).exists():
            from trainer.backends.zero_optimizer import load_optimizer_state

            load_optimizer_state(backend.engine, parent / OPTIMIZER_FILE)
        return backend

    def _logprobs(self, actor: Any, ob: OpenRLHFBatch) -> torch.Tensor:
        return actor(ob.sequences, action_mask=ob.action_mask, attention_mask=ob.attention_mask)

    @torch.no_grad()
    def _ref_logprobs(self, ob: OpenRLHFBatch) -> torch.Tensor:
        if self.ref is not None:
            return self._logprobs(self.ref, ob)
        with self.engine.module.disable_adapter():  # LoRA: the base model is the adapter switched off
            return self._logprobs(self.actor, ob)

    def train(
        self,
        batches: Sequence[Batch],
        on_step: StepCallback | None = None,
        threads_now: Callable[[], int] | None = None,
    ) -> TrainMetrics:
        """Every rank gets all of the round's ``batches`` and trains its share of each step (module
        docstring); metrics are those of the torch backend, summed over ranks the same way.
        ``threads_now`` is the torch backend's in-process hook: ranks keep ``--threads``."""
        s = self.settings
        t0 = time.perf_counter()
        rank, world = rank_world()
        mine = step_plan(len(batches), s.steps_per_epoch, rank, world)
        r = self._round_inputs(batches, mine, world)
        m, iw, resp_tokens = TrainMetrics(), ImportanceStats(), 0.0
        for _epoch in range(s.epochs):
            for j, idx in enumerate(mine):
                if r.step_weight[j] <= 0:
                    continue
                n_calls = -(-len(r.steps[j]) // world)  # rank 0's count, the largest: every rank makes it
                calls = idx + [r.steps[j][0]] * (n_calls - len(idx))  # zero-weighted padding after ours
                for c, i in enumerate(calls):
                    self.engine.set_gradient_accumulation_boundary(c == n_calls - 1)
                    if c >= len(idx):
                        self.strategy.backward(
                            self._logprobs(self.actor, r.obs[i]).sum() * 0.0, self.actor, None
                        )
                        continue
                    resp_tokens += self._micro_batch(r, j, i, m, iw)
                    m.tokens += batches[i].n_tokens
                self.strategy.optimizer_step(None, self.actor, None)
                m.grad_norm = self.strategy.get_grad_norm(self.actor)
                m.optimizer_steps += 1
                if on_step is not None:
                    on_step(m.optimizer_steps, m)
        m.seconds = time.perf_counter() - t0
        iw.into(m)
        return finish_metrics(m, resp_tokens, self.device, world)

    def _round_inputs(self, batches: Sequence[Batch], mine: list[list[int]], world: int) -> _RoundInputs:
        """The batches as OpenRLHF experiences, each step's weight and token count over all ranks, and for this
        rank's batches pi_old (only when a later step trains off-policy) and the reference's logprobs."""
        s = self.settings
        steps = step_plan(len(batches), s.steps_per_epoch)
        pad_id = self.tokenizer.pad_token_id or 0
        obs = {i: openrlhf_batch(batches[i], pad_id).to(self.device) for idx in steps for i in idx}
        local = [i for idx in mine for i in idx]
        with torch.no_grad():
            old = {i: self._logprobs(self.actor, obs[i]) for i in local} if s.epochs * len(steps) > 1 else {}
        return _RoundInputs(
            steps=steps,
            obs=obs,
            old=old,
            ref={i: self._ref_logprobs(obs[i]) for i in local} if s.kl_coef > 0 else {},
            step_weight=[float(sum(batches[i].weights.sum().item() for i in idx)) for idx in steps],
            step_tokens=[float(sum((batches[i].weights > 0).sum().item() for i in idx)) for idx in steps],
            world=world,
            share=1.0 / (s.epochs * len(steps)),
        )

    def _micro_batch(self, r: _RoundInputs, j: int, i: int, m: TrainMetrics, iw: ImportanceStats) -> float:
        """Forward and backward of batch ``i`` in step ``j`` (OpenRLHF's PolicyLoss, plus the KL to the
        reference), its share added to ``m`` and ``iw``; returns its response tokens."""
        from openrlhf.models.utils import compute_approx_kl

        s, ob, world = self.settings, r.obs[i], r.world
        logp = self._logprobs(self.actor, ob)
        act = ob.action_mask.float()
        old_lp = r.old.get(i, logp.detach())
        rollout = torch.where(ob.has_rollout_log_probs, ob.rollout_log_probs, old_lp)
        iw.add(old_lp, ob.rollout_log_probs, ob.has_rollout_log_probs & ob.action_mask.bool())
        loss, clip, ppo_kl, _, filtered = self.loss_fn(
            logp,
            old_lp,
            ob.folded_advantages(r.step_weight[j], r.step_tokens[j]),
            action_mask=act,
            rollout_log_probs=rollout,
            dp_size=world,
            batch_num_tokens=r.step_tokens[j],
        )
        kl = torch.zeros(())
        if i in r.ref:
            kl_t = compute_approx_kl(logp, r.ref[i], kl_estimator=s.kl_estimator)
            kl = (kl_t * ob.weights / r.step_weight[j]).sum()
        total = loss + s.kl_coef * world * kl  # both times world: ZeRO averages over ranks
        self.strategy.backward(total, self.actor, None)
        n_resp = float(act.sum().item())
        m.policy_loss += loss.item() / world * r.share
        m.kl += kl.item() * r.share
        m.loss += total.item() / world * r.share
        m.clip_fraction += float(clip) * n_resp
        m.ppo_kl += float(ppo_kl) * n_resp
        m.is_filtered_fraction += float(filtered if filtered is not None else 0.0) * n_resp
        m.micro_batches += 1
        return n_resp

    def save(self, out_dir: Path) -> None:
        """Collective (every rank calls it, like DeepSpeed's ``save_model``); rank 0 writes: HF weights
        or adapter, tokenizer, and ``optimizer.pt``."""
        from trainer.backends.zero_optimizer import save_optimizer_state

        self.strategy.save_model(self.actor, self.tokenizer, str(out_dir))
        save_optimizer_state(
            self.engine,
            out_dir / OPTIMIZER_FILE,
            self.settings.lr,
            self.settings.weight_decay,
            write=rank_world()[0] == 0,
        )


def _actor(models: Any, model: Any) -> Any:
    """Wrap a loaded HF/PEFT model in OpenRLHF's ``Actor`` as its path constructor would leave it:
    samples packed, no KV cache (transformers splits packed rows on ``position_ids`` only without one)."""
    actor = models.Actor(model)
    actor.packing_samples = True
    model.config.use_cache = False
    return actor
