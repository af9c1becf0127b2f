"""Loading the policy and its KL reference: one way, for every backend.

Round 0 starts from the base model, later rounds from the previous checkpoint: full weights, or a
LoRA adapter (``adapter_config.json``) on top of the base. With ``--lora-rank`` a fresh adapter is
added to the base. The KL reference (``--kl-coef > 0``) is the base model: for LoRA the same model
with its adapter switched off (no copy), for full fine-tuning a frozen copy, returned here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.config import TrainSettings


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def is_adapter_checkpoint(path: Path) -> bool:
    return (path / "adapter_config.json").exists()


def load_policy(
    settings: TrainSettings,
    base_model: Path,
    parent: Path | None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> tuple[Any, Any | None]:
    """(policy, frozen reference or None), in ``dtype``, on the CPU (the backend moves them). Seeded
    first: a fresh adapter starts the same in every backend and every rank."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(settings.seed)

    def load(path: Path) -> Any:
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)

    if settings.lora_rank > 0 or (parent is not None and is_adapter_checkpoint(parent)):
        from peft import LoraConfig, PeftModel, get_peft_model

        if parent is not None and is_adapter_checkpoint(parent):
            return PeftModel.from_pretrained(load(base_model), str(parent), is_trainable=True), None
        targets = settings.lora_targets
        target_modules: Any = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
        cfg = LoraConfig(
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            target_modules=target_modules,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(load(base_model), cfg), None
    ref = None
    if settings.kl_coef > 0:
        ref = load(base_model).eval()
        ref.requires_grad_(False)
    return load(resume_weights(parent) if parent is not None else base_model), ref


def resume_weights(checkpoint: Path) -> Path:
    """The full weights a round continues from: the checkpoint's fp32 ``master/`` copy when it has one
    (its served weights are bf16: rounding the trained weights to bf16 every round would undo updates
    smaller than bf16's step), else the checkpoint itself."""
    master = checkpoint / "master"
    return master if (master / "config.json").is_file() else checkpoint
