"""Advantage estimators: one number per rollout, computed within its task group, copied to its calls.

An agent rollout is one run on one task; it may make many model calls, and the reward belongs to
the rollout. So advantages are computed per rollout, relative to the other rollouts of the same
task (the group), and every call of the rollout trains with that one advantage. Groups whose
rewards are all equal carry no signal (every advantage would be 0, or 0/0 for grpo): they are
dropped and counted.

Each estimator is a plain function ``rewards of one group -> advantages of that group``:

    grpo:                (r_i - mean(r)) / (std(r) + eps)        std with Bessel's correction (torch.std)
    rloo:                r_i - mean(r_j for j != i)              leave-one-out baseline
    reinforce_baseline:  r_i - mean(r)                           group-mean baseline, unscaled
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


def grpo(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """Group-normalised reward (GRPO, DeepSeekMath eq. 3): centre on the group mean, scale by its std."""
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) for r in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): baseline is the mean of the *other* rollouts."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def reinforce_baseline(rewards: Sequence[float]) -> list[float]:
    """REINFORCE with the group mean as baseline, not rescaled (keeps the reward's units)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


ESTIMATORS: dict[str, Callable[[Sequence[float]], list[float]]] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_baseline": reinforce_baseline,
}


@dataclass(frozen=True)
class RolloutReward:
    """The reward of one finished rollout and the task it belongs to (the group key)."""

    rollout_id: str
    task_id: str
    reward: float


@dataclass
class AdvantageResult:
    """Per-rollout advantages plus what was dropped and why, for the round metrics."""

    advantages: dict[str, float] = field(default_factory=dict)
    n_groups: int = 0
    n_groups_dropped_zero_variance: int = 0
    n_rollouts_dropped: int = 0


def rollout_advantages(
    rollouts: Iterable[RolloutReward], estimator: str = "grpo", *, min_std: float = 1e-8
) -> AdvantageResult:
    """Group rollouts by task, apply ``estimator`` within each group, drop zero-variance groups.

    A group of one rollout has zero variance by definition and is dropped too: there is nothing to
    compare it with. The result is keyed by rollout id so callers can copy it onto every call.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; must be one of {', '.join(ESTIMATORS)}")
    fn = ESTIMATORS[estimator]
    groups: dict[str, list[RolloutReward]] = {}
    for r in rollouts:
        groups.setdefault(r.task_id, []).append(r)
    out = AdvantageResult(n_groups=len(groups))
    for task_id in sorted(groups):
        group = groups[task_id]
        rewards = [r.reward for r in group]
        mean = sum(rewards) / len(rewards)
        if len(group) < 2 or max(abs(x - mean) for x in rewards) <= min_std:
            out.n_groups_dropped_zero_variance += 1
            out.n_rollouts_dropped += len(group)
            continue
        for r, a in zip(group, fn(rewards), strict=True):
            out.advantages[r.rollout_id] = a
    return out


def per_rollout_token_weights(rollout_of_sample: Sequence[str], n_tokens: Sequence[int]) -> list[float]:
    """Loss weight of each token of each sample so that every rollout counts equally.

    A rollout with 10 calls of 100 tokens must not outweigh a rollout with one call of 20 tokens:
    each rollout's tokens share a total weight of 1/n_rollouts, spread evenly over its tokens
    (weight = 1 / (n_rollouts * tokens_of_rollout)). Summing weight * per-token loss over the whole
    batch then gives the mean over rollouts of each rollout's token-mean loss. Returned per sample.
    """
    totals: dict[str, int] = {}
    for rid, n in zip(rollout_of_sample, n_tokens, strict=True):
        totals[rid] = totals.get(rid, 0) + n
    n_rollouts = sum(1 for t in totals.values() if t > 0)
    return [0.0 if totals[rid] == 0 else 1.0 / (n_rollouts * totals[rid]) for rid in rollout_of_sample]
