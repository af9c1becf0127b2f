"""Token log-probabilities from hidden states, a chunk of tokens at a time: the LM head's logits never
exist for a whole batch at once.

Why: the logits are ``tokens x vocab``. For a Qwen2.5-1.5B-shaped model (152k vocab) a 30k-token step
holds 9 GiB of bf16 logits, 18 GiB more as fp32 for the log-softmax, and autograd keeps both for the
backward pass: more than the model, its LoRA state and its activations together. Here the head runs on
``CHUNK_TOKENS`` hidden states at a time, each chunk reduced at once to one log-probability per token,
and under a non-reentrant ``torch.utils.checkpoint`` the backward pass recomputes a chunk's logits from
its hidden states instead of storing them. Memory for the head then is one chunk's logits, whatever the
batch; the price is one more head matmul per chunk in the backward pass (the head is ~1/7 of a 1.5B
model's forward FLOPs). The same idea as Liger-Kernel's fused linear cross-entropy and OpenRLHF's
chunked logprobs, here in plain torch so it runs on CPUs and every GPU.

``split_head`` decides whether a model's logits are exactly ``head(decoder(x))``; models that scale or
soft-cap their logits (Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``) are scored through their own forward instead (``trainer/packing.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 1024
"""Tokens whose logits exist at once on a GPU: 1024 x 152k vocab is 0.3 GiB bf16, 0.6 GiB fp32, and as much
again for its gradient; a head matmul of 1024 rows still keeps a GPU busy."""

CPU_CHUNK_BYTES = 24 << 20
"""On a CPU a chunk's fp32 logits stay below glibc's 32 MiB mmap cap (``trainer/cpu_memory.py``), so they
come from the heap the previous chunk freed instead of fresh pages the kernel must fault in and zero: 128
tokens for SmolLM2's 49k vocab, 41 for a 152k one. A 640-token LoRA micro-batch of SmolLM2 then faulted
~2k pages instead of 40-60k alone (and up to 370k in the demo, beside its rollouts), at no loss of speed:
1.45-1.50 s against 1.57-1.60 s (one thread, 2-core CPU)."""

MIN_CHUNK_TOKENS = 16

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def split_head(model: Any) -> tuple[Any, Any] | None:
    """``(decoder, head)`` when the model's logits are exactly ``head(decoder(...).last_hidden_state)``,
    else None. Works through a PEFT wrapper (its attribute lookups reach the base model; a LoRA-wrapped
    head stays wrapped, so its adapter applies)."""
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is model:
        return None
    return decoder, head


def _chunk_logprobs(head: Any, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return logits.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def chunk_tokens_for(device: torch.device, vocab: int) -> int:
    """The head's chunk on ``device``: ``CHUNK_TOKENS`` on a GPU; on a CPU the most tokens whose fp32 logits
    fit ``CPU_CHUNK_BYTES`` (at least ``MIN_CHUNK_TOKENS``, at most ``CHUNK_TOKENS``)."""
    if device.type != "cpu":
        return CHUNK_TOKENS
    return max(MIN_CHUNK_TOKENS, min(CHUNK_TOKENS, CPU_CHUNK_BYTES // (4 * max(1, vocab))))


def head_logprobs(head: Any, hidden: torch.Tensor, next_ids: torch.Tensor,
                  chunk_tokens: int | None = None) -> torch.Tensor:
    """``log p(next_ids[i] | hidden[i])`` for ``hidden [N, H]`` and ``next_ids [N]``, in fp32.

    Chunks of ``chunk_tokens`` rows (None: ``chunk_tokens_for`` the hidden states' device and the head's
    vocabulary); with autograd on, each chunk is checkpointed, so the backward pass keeps only the hidden
    states, not the logits."""
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(hidden.device, getattr(head, "out_features", None) or head.weight.shape[0])
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = []
    for i in range(0, hidden.shape[0], chunk_tokens):
        h, ids = hidden[i:i + chunk_tokens], next_ids[i:i + chunk_tokens]
        if grad:
            parts.append(checkpoint(_chunk_logprobs, head, h, ids, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, ids))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
