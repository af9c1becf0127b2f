"""Fold a LoRA checkpoint into its base model's weights, for engines where adapters are slow.

On CPU vLLM a model served through a LoRA adapter runs about 4x slower than the same model with
the adapter merged (SmolLM2-135M: 18-20 against 62-91 tokens/s, ../shared/ENVIRONMENT.md), while a
full-weight reload takes under a second; so there a LoRA round is published as merged weights.
Training still continues from the adapter (and its optimizer state); the merged copy is only
what the engine reads. The merge is peft's ``merge_and_unload`` (W + scale * B @ A per target
module), saved in fp32 inside the checkpoint it came from, with the checkpoint writer's guarantees
(a temp directory fsynced and renamed into place). Not bf16: after one Adam step at lr 1e-3 an
entry of SmolLM2's LoRA update is about 1e-4 to 1e-3, the size of half a bf16 step of a weight
near 0.05 (8 bits of mantissa), so a bf16 merge serves a coarsely rounded policy. (Measured on the
demo, this did not show beyond run-to-run noise: served in bf16, held-out success went 0.042 ->
0.150; in fp32, 0.042 -> 0.242 and 0.042 -> 0.158.) An engine serving bf16 rounds the weights
anyway; one serving fp32 (the demo's) serves the policy trained.

How: the adapters the trainer writes are plain LoRA (one rank and alpha, no DoRA, biases or saved
modules), whose merge is ``W + (B @ A) * scale`` per target, the arithmetic of peft's ``merge_and_unload``
(``LoraLayer.get_delta_weight`` then ``weight += delta``, peft 0.18), so those are folded straight into the
base's safetensors tensors (``fold_lora``), without building the model twice (a base model, then a
``PeftModel`` around it): the whole merge, written and fsynced, took 1.19 s that way and takes 0.58 s now
(SmolLM2, r16 on q/k/v/o, 2 quiet cores), on every CPU round's publish. An adapter with anything more is
merged by peft itself.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from trainer.checkpoint import is_complete, write_checkpoint

MERGED = "merged"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def copy_tokenizer_files(src: Path, dst: Path) -> bool:
    """Copy the base model's tokenizer (and generation config) files into ``dst``, as they are; False when
    ``src`` holds none of a tokenizer's own files (the caller then saves one through transformers).

    Why copy, not ``AutoTokenizer.from_pretrained(...).save_pretrained(...)``: a checkpoint's tokenizer
    is the base model's, and loading it parses its JSON in Python: 2-3 s a round on 2 busy cores for
    SmolLM2, on the trainer's critical path (py-spy of ``tracerl demo --max-staleness 1``)."""
    copied = [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]
    for name in copied:
        shutil.copy2(Path(src) / name, Path(dst) / name)
    return any(name in copied for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def merged_dir(checkpoint: Path) -> Path:
    """Where the merged weights of a LoRA checkpoint live: a subdirectory the checkpoint owns, so
    pruning the checkpoint prunes them too."""
    return Path(checkpoint) / MERGED


def merge_adapter(base_model: Path, checkpoint: Path, *, dtype: str = "float32") -> Path:
    """Write base + the checkpoint's adapter as one HF model in ``merged_dir(checkpoint)``.

    Idempotent: a finished merge is reused, so a retried publish does not merge twice; the
    temp directory of a merge killed midway is removed first.
    """
    out = merged_dir(checkpoint)
    if is_complete(out):
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    for stale in Path(checkpoint).glob(f".{MERGED}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    torch_dtype = getattr(torch, dtype)
    tensors = _folded(base_model, checkpoint, torch_dtype)
    if tensors is None:  # more than plain LoRA: peft merges it
        tensors = _peft_merged(base_model, checkpoint, torch_dtype)
    config = AutoConfig.from_pretrained(str(base_model))
    config.dtype = torch_dtype

    def save(tmp: Path) -> None:
        # safetensors' own writer: transformers' save_pretrained took 3.0 s for these 270 MB, this 0.4 s
        # (SmolLM2, 2 cores), and publish time is the engine's idle time
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        copy_tokenizer_files(Path(base_model), tmp)  # a whole model, servable alone

    return write_checkpoint(out, save, {"merged_from": str(checkpoint), "base_model": str(base_model),
                                        "dtype": dtype})


ADAPTER_PREFIX = "base_model.model."  # peft's name for the wrapped model, before each module's own name


def plain_lora_scale(config: dict[str, Any]) -> float | None:
    """The one scale (alpha / r, or alpha / sqrt(r) with rsLoRA) of a plain LoRA adapter's config
    (``adapter_config.json``); None when the adapter is more than that (DoRA, per-module ranks or alphas,
    transposed weights, trained biases, whole modules saved beside it), which ``fold_lora`` does not merge."""
    if config.get("peft_type", "LORA") != "LORA" or not config.get("r"):
        return None
    if config.get("use_dora") or config.get("fan_in_fan_out") or config.get("lora_bias"):
        return None
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        return None
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("target_parameters"):
        return None
    r, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def fold_lora(base: dict[str, Any], adapter: dict[str, Any], scale: float, dtype: Any) -> dict[str, Any] | None:
    """The base's tensors, each LoRA target's weight with ``(B @ A) * scale`` added (in fp32), all in ``dtype``;
    None when the adapter holds a tensor that is not a LoRA A or B of a base weight of the right shape."""
    import torch

    pairs: dict[str, dict[str, Any]] = {}
    for name, t in adapter.items():
        module, _, part = name.removeprefix(ADAPTER_PREFIX).rpartition(".lora_")
        if not name.startswith(ADAPTER_PREFIX) or part not in ("A.weight", "B.weight"):
            return None
        pairs.setdefault(module + ".weight", {})[part[0]] = t
    out = {name: t.to(torch.float32) for name, t in base.items()}
    for name, ab in pairs.items():
        w = out.get(name)
        if w is None or set(ab) != {"A", "B"} or w.shape != (ab["B"].shape[0], ab["A"].shape[1]):
            return None
        out[name] = w + (ab["B"].to(torch.float32) @ ab["A"].to(torch.float32)) * scale
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def _folded(base_model: Path, checkpoint: Path, dtype: Any) -> dict[str, Any] | None:
    """``fold_lora`` over the base's safetensors files and the checkpoint's adapter; None: peft must merge."""
    from safetensors.torch import load_file

    from serving.models.weights import read_weights

    config = json.loads((Path(checkpoint) / "adapter_config.json").read_text())
    scale = plain_lora_scale(config)
    adapter = Path(checkpoint) / "adapter_model.safetensors"
    if scale is None or not adapter.is_file():
        return None
    base = read_weights(base_model)
    return fold_lora(base, load_file(str(adapter)), scale, dtype) if base else None


def _peft_merged(base_model: Path, checkpoint: Path, dtype: Any) -> dict[str, Any]:
    """peft's ``merge_and_unload``, for adapters beyond plain LoRA; tied tensors (lm_head = embed_tokens) are
    written once, under the first name, as save_pretrained writes them."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload().to(dtype)
    seen: set[int] = set()
    tensors = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            tensors[name] = t.contiguous()
    return tensors


def served_weights(checkpoint: Path | None, adapter: bool, base_model: Path) -> Path:
    """The full weights an engine holds once ``checkpoint`` was published (what a failed reload
    restores): its merged copy or the checkpoint itself, else the base model (round 0, or an
    adapter served by name on top of the base)."""
    if checkpoint is None:
        return base_model
    if not adapter:
        return checkpoint
    return merged_dir(checkpoint) if is_complete(merged_dir(checkpoint)) else base_model
