"""One decoding step's math, as vLLM does it (checked against vllm-project/vllm v0.10.2 - v0.11).

``process_logits`` applies vLLM's logits processors; ``sample`` picks a token per row: greedy when
``temperature`` is 0, otherwise temperature, then top-k, then top-p, from the request's own seeded
generator. The logprobs it returns follow ``logprobs_mode``: ``raw_logprobs`` (vLLM's default,
``vllm/config/model.py``) is the log-softmax of the unmodified logits; ``processed_logprobs`` is the
distribution actually sampled from.
"""

from __future__ import annotations

from typing import Any

from serving.embedded.sampling import SamplingParams

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
_EPS = 1e-5


def process_logits(
    logits: Any, p: SamplingParams, counts: Any, seen: Any, stop_ids: set[int], n_generated: int
) -> Any:
    """vLLM's logits processors, in its order: min_tokens, logit_bias, then the penalties.

    ``counts`` holds how often each token was generated per row, ``seen`` which tokens
    appear in prompt or output (repetition penalty, as vLLM/HF define it).
    """
    import torch

    x = logits.clone()
    if p.min_tokens and n_generated < p.min_tokens and stop_ids:
        x[:, sorted(stop_ids)] = float("-inf")
    for tok, bias in p.logit_bias.items():
        if 0 <= tok < x.shape[-1]:
            x[:, tok] += bias
    if p.repetition_penalty != 1.0:
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    if p.frequency_penalty:
        x = x - p.frequency_penalty * counts
    if p.presence_penalty:
        x = x - p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def sample(
    logits: Any, p: SamplingParams, gen: Any, logprobs_mode: str, processed_logits: Any | None = None
) -> tuple[Any, Any, list | None]:
    """Pick one token per row; returns (tokens, logprob of each, top-k alternatives or None)."""
    import torch

    raw = torch.log_softmax(logits, dim=-1)
    x = logits if processed_logits is None else processed_logits
    if p.temperature < _EPS:
        tokens = x.argmax(dim=-1)
        processed = torch.log_softmax(x, dim=-1) if processed_logits is not None else raw
    else:
        scaled = x / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_l, idx = torch.sort(scaled, dim=-1, descending=True)
            probs = torch.softmax(sorted_l, dim=-1)
            # drop a token when the mass before it already reaches top_p (always keep the first)
            drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
            sorted_l = sorted_l.masked_fill(drop, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(-1, idx, sorted_l)
        processed = torch.log_softmax(scaled, dim=-1)
        tokens = torch.multinomial(processed.exp(), 1, generator=gen).view(-1)
    src = raw if logprobs_mode == "raw_logprobs" else processed
    chosen = src.gather(-1, tokens.view(-1, 1)).view(-1)
    top = None
    if p.logprobs:
        vals, idx = torch.topk(src, min(p.logprobs, src.shape[-1]), dim=-1)
        top = [
            [(int(t), float(v)) for t, v in zip(idx[i], vals[i], strict=True)] for i in range(src.shape[0])
        ]
    return tokens, chosen, top
