"""A DeepSpeed engine's Adam state as the torch backend's ``optimizer.pt``, and back.

Checkpoints carry the optimizer between rounds in one format whatever trained them: a
``torch.optim.AdamW.state_dict()`` over the trainable parameters in ``model.parameters()`` order,
one group (``TorchBackend.save``). DeepSpeed's own checkpoints would tie round k+1 to round k's
rank count (ZeRO partitions are per rank) and repeat the model weights; this one does neither, and
either backend can continue from it.

ZeRO 1/2 (and the bf16 optimizer) keep each rank's share of the fp32 master weights as flat
partitions; DeepSpeed's public ``safe_get_full_optimizer_state`` / ``safe_set_full_optimizer_state``
(deepspeed/utils/tensor_fragment.py, 0.19.6) gather and scatter one parameter's moments across the
data-parallel ranks (collectives: every rank calls them, in the same order). The partitions' state
exists only after the first ``step``, so restoring first creates it (``step`` and zeroed moments)
and links it to the parameters as DeepSpeed does after a step (``_lazy_init_hp_params_optimizer_state``).
DeepSpeed 0.19.6 does that linking once, right after stepping the *first* parameter group, so the
fragments of later groups point at no state; saving links them again first.
Without ZeRO in fp32 the engine's optimizer is the torch optimizer itself, keyed by parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _flat_partitions(zero: Any) -> list[torch.Tensor] | None:
    """This rank's flat fp32 partitions (ZeRO 1/2: ``single_partition_of_fp32_groups``; bf16 optimizer:
    ``fp32_groups_flat_partition``), or None when the optimizer is a plain torch one."""
    for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(zero, name):
            return list(getattr(zero, name))
    return None


def _trainable(engine: Any) -> list[torch.nn.Parameter]:
    return [p for p in engine.module.parameters() if p.requires_grad]


def save_optimizer_state(engine: Any, path: Path, lr: float, weight_decay: float, write: bool) -> None:
    """Gather the full Adam state (collective: call on every rank); the rank with ``write`` saves it."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero = engine.optimizer
    base = getattr(zero, "optimizer", zero)  # the torch AdamW inside ZeRO's wrapper
    if not base.state:
        return  # no step taken: nothing to carry
    step = next(iter(base.state.values()))["step"]  # one count per flat partition, equal across them
    params = _trainable(engine)
    flat = _flat_partitions(zero) is not None
    if flat:  # DeepSpeed links the fragments after the first group's first step, when the other groups
        # (OpenRLHF makes two: with and without weight decay) have no state yet; link them again now
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for p in params:
        moments = {k: (safe_get_full_optimizer_state(p, k) if flat else base.state[p][k]) for k in MOMENTS}
        state[p] = {
            "step": step.detach().float().cpu().clone(),
            **{k: v.float().cpu() for k, v in moments.items()},
        }
    if not write:
        return
    holder = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)  # only for its state_dict() layout
    holder.state.update(state)
    torch.save(holder.state_dict(), path)


def load_optimizer_state(engine: Any, path: Path) -> None:
    """Restore moments and step from ``optimizer.pt`` into the engine (collective for ZeRO: every rank)."""
    from deepspeed.utils import safe_set_full_optimizer_state

    saved = torch.load(path, map_location="cpu", weights_only=True)["state"]
    params = _trainable(engine)
    if len(saved) != len(params):
        raise ValueError(
            f"{path} holds optimizer state for {len(saved)} parameters, the model trains "
            f"{len(params)}; was it written for another model or LoRA setting?"
        )
    zero = engine.optimizer
    base = getattr(zero, "optimizer", zero)
    step = saved[0]["step"].float()
    partitions = _flat_partitions(zero)
    if partitions is None:
        for i, p in enumerate(params):
            base.state[p] = {
                "step": step.clone(),
                **{k: saved[i][k].to(p.device, torch.float32) for k in MOMENTS},
            }
        return
    for flat in partitions:
        base.state[flat] = {"step": step.clone(), **{k: torch.zeros_like(flat) for k in MOMENTS}}
    zero._lazy_init_hp_params_optimizer_state()
    for i, p in enumerate(params):
        for k in MOMENTS:
            safe_set_full_optimizer_state(p, saved[i][k].to(p.device, torch.float32), k)
