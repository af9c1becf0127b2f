"""The policy loss: PPO-clip with OpenRLHF ``PolicyLoss`` semantics, written as small pure functions.

Shapes: every tensor is ``[rows, tokens]`` aligned on the *predicted* token, and ``weights`` holds
each token's share of the batch loss (zero on prompt and padding tokens). Expressing the
reduction as weights lets one code path do OpenRLHF's token-level mean (weight 1/N_tokens), its
sequence-level mean (1/(len_seq * N_seqs)) and our per-rollout normalisation, and it makes
gradient accumulation and packing exact: the batch loss is a plain weighted sum, so splitting the
batch into micro-batches and adding their losses gives the same number.

    ratio  = exp(clamp(logp - old_logp, -20, 20))
    loss_t = -min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A)       (dual clip optional)
    loss_t *= is_weight   with is_weight = clamp(exp(old_logp - rollout_logp), low, high)   (TIS)
    loss   = sum_t w_t * loss_t  +  kl_coef * sum_t w_t * kl_t(logp, ref_logp)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.choices import IS_CORRECTIONS, KL_ESTIMATORS

if TYPE_CHECKING:
    from trainer.backends.base import TrainMetrics



@dataclass
class LossConfig:
    """PPO-clip hyperparameters (names follow OpenRLHF's flags where one exists)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    is_correction: str = "clip"
    is_threshold_low: float = 0.5
    is_threshold_high: float = 5.0


@dataclass
class LossOutput:
    """The scalar to backpropagate plus detached diagnostics (each a masked token mean)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    ppo_kl: torch.Tensor
    is_filtered_fraction: torch.Tensor


def ppo_clip_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss and a bool tensor of the tokens where clipping was active.

    Asymmetric clip (``eps_low`` != ``eps_high``, DAPO's clip-higher) and dual clip (Ye et al.
    2019: bound the loss of negative-advantage tokens by ``dual_clip * A``) as in OpenRLHF.
    """
    ratio = (logprobs - old_logprobs).clamp(min=-20.0, max=20.0).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * advantages
    clip1 = torch.min(surr1, surr2)
    if dual_clip is None:
        loss = -clip1
    else:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
        loss = -torch.where(advantages < 0, torch.max(clip1, dual_clip * advantages), clip1)
    return loss, surr2 < surr1


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mode: str = "clip",
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct for the serving engine sampling from a slightly different distribution than ours.

    The ratio pi_train/pi_rollout per token (detached). ``clip`` clamps it to [low, high]
    (truncated importance sampling); ``mask`` keeps in-band tokens with their ratio and zeroes the
    rest; ``off`` gives 1. Tokens without serving logprobs should carry ``rollout = old`` (ratio 1).
    Returns (weights, filtered) where ``filtered`` marks out-of-band tokens.
    """
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"unknown importance correction {mode!r}; must be one of {', '.join(IS_CORRECTIONS)}")
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    ratio = log_ratio.exp()
    filtered = (ratio < low) | (ratio > high)
    if mode == "off":
        return torch.ones_like(ratio), torch.zeros_like(filtered)
    if mode == "clip":
        return ratio.clamp(min=low, max=high), filtered
    return torch.where(filtered, torch.zeros_like(ratio), ratio), filtered


@dataclass
class ImportanceStats:
    """Running sums of the raw importance ratio pi_old / pi_behaviour over tokens the engine scored."""

    tokens: float = 0.0
    weight_sum: float = 0.0
    weight_max: float = 0.0
    weight_min: float = math.inf

    def add(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, scored: torch.Tensor) -> None:
        """``scored``: the response tokens that carry the engine's logprob (the others have no ratio)."""
        if not bool(scored.any()):
            return
        ratio = (old_logprobs.detach().float() - rollout_logprobs.float())[scored].clamp(-20, 20).exp()
        self.tokens += float(ratio.numel())
        self.weight_sum += float(ratio.sum())
        self.weight_max = max(self.weight_max, float(ratio.max()))
        self.weight_min = min(self.weight_min, float(ratio.min()))

    def into(self, m: TrainMetrics) -> None:
        """Onto a ``TrainMetrics`` (the mean is still a sum there: ``finish_metrics`` divides it)."""
        m.is_tokens = int(self.tokens)
        m.is_weight_mean = self.weight_sum
        m.is_weight_max = self.weight_max
        m.is_weight_min = self.weight_min if self.tokens else 0.0


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r with log r = logp - ref_logp;
    clamped to [-10, 10] like OpenRLHF's ``compute_approx_kl``.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        value = log_ratio**2 / 2.0
    elif estimator == "k3":
        lr = log_ratio.clamp(min=-10)
        value = (-lr).exp() - 1 + lr
    else:
        raise ValueError(f"unknown kl estimator {estimator!r}; must be one of {', '.join(KL_ESTIMATORS)}")
    return value.clamp(min=-10, max=10)


def token_weights(mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """Weights reproducing OpenRLHF's reductions: ``token`` = masked mean over all tokens,
    ``sequence`` = mean over rows of each row's masked token mean (rows with no tokens skipped).
    (Per-rollout weights depend on rollout ids and come from ``advantages.per_rollout_token_weights``.)
    """
    mask = mask.float()
    if level == "token":
        return mask / mask.sum().clamp(min=1.0)
    if level == "sequence":
        per_row = mask.sum(dim=-1, keepdim=True)
        n_rows = (per_row > 0).sum().clamp(min=1)
        return mask / (per_row.clamp(min=1.0) * n_rows)
    raise ValueError(f"unknown aggregation {level!r}; must be 'token' or 'sequence'")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (x.float() * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The full objective for one (micro-)batch: weighted PPO-clip + optional KL to the reference."""
    mask = weights > 0
    loss_t, clipped = ppo_clip_token_loss(
        logprobs, old_logprobs, advantages, config.clip_eps_low, config.clip_eps_high, config.dual_clip
    )
    filtered = torch.zeros_like(mask)
    if rollout_logprobs is not None and config.is_correction != "off":
        is_w, filtered = importance_weights(
            old_logprobs, rollout_logprobs, config.is_correction, config.is_threshold_low, config.is_threshold_high
        )
        loss_t = loss_t * is_w
    pol = (loss_t * weights).sum()
    kl = torch.zeros((), dtype=pol.dtype, device=pol.device)
    if ref_logprobs is not None:
        kl = (approx_kl(logprobs, ref_logprobs, config.kl_estimator) * weights).sum()
    total = pol + config.kl_coef * kl if config.kl_coef else pol
    return LossOutput(
        loss=total,
        policy_loss=pol.detach(),
        kl=kl.detach(),
        clip_fraction=_masked_mean(clipped, mask).detach(),
        ppo_kl=_masked_mean((old_logprobs - logprobs).detach(), mask),
        is_filtered_fraction=_masked_mean(filtered, mask).detach(),
    )
