"""Advantage estimators: one number per rollout, computed within its group, copied to its calls.

An agent rollout is one run on one task; it may make many model calls, and the reward belongs to
the rollout. So advantages are computed per rollout, relative to the other rollouts of its group,
and every call of the rollout trains with that one advantage. Groups whose rewards are all equal
carry no signal (every advantage would be 0, or 0/0 for grpo): they are dropped and counted.

Each estimator is a plain function ``rewards of one group -> advantages of that group``. What a
group is depends on the estimator:

- group estimators (a group is one task's rollouts; a task run once is a group of one, dropped):

    grpo:                (r_i - mean(r)) / (std(r) + eps)        std with Bessel's correction (torch.std)
    rloo:                r_i - mean(r_j for j != i)              leave-one-out baseline
    reinforce_baseline:  r_i - mean(r)                           group-mean baseline, unscaled

- group-free estimators (``GROUP_FREE``; a group is the round's batch of one trained agent, so
  traffic that never repeats a task trains too, and a batch of one is the only singleton dropped):

    reinforce_plus_plus: (r_i - mean(r)) / sqrt(max(var(r), 1e-8))   over the agent's whole batch

``choose_estimator`` resolves ``--estimator auto``: a group estimator where the round's tasks
repeat, the group-free one where they do not.
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


def reinforce_plus_plus(
    rewards: Sequence[float], weights: Sequence[float] | None = None, *, min_var: float = 1e-8
) -> list[float]:
    """REINFORCE++ (Hu et al. 2025): rewards whitened over the whole batch, no task group, no critic.

    This is OpenRLHF 0.11.2's ``--algo.advantage.estimator reinforce`` (the name the paper's
    ``reinforce_plus_plus`` runs under there; ``RemoteExperienceMaker.compute_advantages_and_returns``),
    at our granularity:

    - OpenRLHF puts a sample's scalar reward on its last action token (``compute_reward``; with no
      KL folded into the reward: ours is a loss term, ``--kl-coef``, like their ``--algo.kl.use_loss``)
      and takes gamma=1 cumulative returns (``get_cumulative_returns``): the return at *every* token
      of the sample is that one reward. So before whitening, advantage = reward at every token, and
      one number per sample says it all; here the sample is the rollout (its reward copied to its calls).
    - It then whitens over the batch: mean and population variance over every *action token* of
      every sample (``(a - mean) * rsqrt(clamp(var, 1e-8))``, no eps added, no Bessel). Since each
      sample's tokens all carry its one number, that is a mean and variance over samples weighted by
      their token counts. ``weights`` are those weights: give token counts to reproduce OpenRLHF
      exactly (the parity test does); the trainer gives every rollout weight 1 (the default),
      because its loss counts every rollout equally (``--aggregation rollout``), so a long rollout
      must not pull the baseline towards its reward either. With equal lengths the two agree.
    - OpenRLHF's batch is the rollout batch of one actor; ours is the round's rollouts of one trained
      agent (``rollout_advantages`` batches by ``RolloutReward.agent``).
    """
    n = len(rewards)
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    total = sum(w)
    mean = sum(wi * r for wi, r in zip(w, rewards, strict=True)) / total
    var = sum(wi * (r - mean) ** 2 for wi, r in zip(w, rewards, strict=True)) / total
    rstd = 1.0 / math.sqrt(max(var, min_var))
    return [(r - mean) * rstd for r in rewards]


ESTIMATORS: dict[str, Callable[[Sequence[float]], list[float]]] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_baseline": reinforce_baseline,
    "reinforce_plus_plus": reinforce_plus_plus,
}
GROUP_FREE = frozenset({"reinforce_plus_plus"})
"""Estimators whose group is the agent's whole batch, not a task."""


@dataclass(frozen=True)
class RolloutReward:
    """The reward of one finished rollout, the task it belongs to (a group estimator's group) and the
    trained agent it belongs to (a group-free estimator's batch: its first trained call's agent)."""

    rollout_id: str
    task_id: str
    reward: float
    agent: str = ""


@dataclass
class AdvantageResult:
    """Per-rollout advantages plus what was dropped and why, for the round metrics.

    A "group" is what the estimator normalised over: a task's rollouts for a group estimator, an
    agent's batch for a group-free one (``grouped_by`` says which).
    """

    advantages: dict[str, float] = field(default_factory=dict)
    n_groups: int = 0
    n_groups_dropped_zero_variance: int = 0
    n_rollouts_dropped: int = 0
    grouped_by: str = "task"


def rollout_advantages(
    rollouts: Iterable[RolloutReward], estimator: str = "grpo", *, min_std: float = 1e-8
) -> AdvantageResult:
    """Group rollouts (by task, or by agent for a ``GROUP_FREE`` estimator), apply ``estimator`` within
    each group, drop zero-variance groups.

    A group of one rollout has zero variance by definition and is dropped too: there is nothing to
    compare it with. Under a group-free estimator the singletons of task grouping are not groups at
    all: only an agent batch whose rewards are all equal (or that has one rollout) is dropped. The
    result is keyed by rollout id so callers can copy it onto every call.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; must be one of {', '.join(ESTIMATORS)}")
    fn = ESTIMATORS[estimator]
    by_agent = estimator in GROUP_FREE
    groups: dict[str, list[RolloutReward]] = {}
    for r in rollouts:
        groups.setdefault(r.agent if by_agent else r.task_id, []).append(r)
    out = AdvantageResult(n_groups=len(groups), grouped_by="agent" if by_agent else "task")
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


AUTO = "auto"
GROUP_ESTIMATOR = "grpo"
GROUP_FREE_ESTIMATOR = "reinforce_plus_plus"
REPEAT_SHARE = 0.5
"""``auto`` picks the group estimator when at least this share of the round's rollouts share their task
with another rollout. A group estimator learns only from rollouts in groups of two or more (a task
run once is dropped), so below one half it would throw away most of the round; from one half up, the
per-task baseline (each task's difficulty taken out of the reward) is worth more than the singletons
it drops. The replayed task sets of ``tracerl rollout`` sit at 1.0, a service's distinct requests at
0.0, so the rule is rarely near its edge."""


@dataclass(frozen=True)
class EstimatorChoice:
    """The estimator a round uses and why (the round manifest's ``estimator``/``estimator_reason``)."""

    estimator: str
    reason: str


def choose_estimator(rollouts: Sequence[RolloutReward], requested: str = AUTO) -> EstimatorChoice:
    """Resolve ``--estimator``: a named one is used as is; ``auto`` applies the ``REPEAT_SHARE`` rule.

    "Repeat" is precise: the share of rollouts whose ``task_id`` is also the task of at least one other
    rollout of the round (the rollouts a group estimator can use). No rollouts: the group estimator.
    """
    if requested != AUTO:
        if requested not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {requested!r}; must be one of auto, {', '.join(ESTIMATORS)}")
        return EstimatorChoice(requested, "set by --estimator")
    sizes: dict[str, int] = {}
    for r in rollouts:
        sizes[r.task_id] = sizes.get(r.task_id, 0) + 1
    n = len(rollouts)
    repeated = sum(c for c in sizes.values() if c >= 2)
    share = repeated / n if n else 1.0
    pick = GROUP_ESTIMATOR if share >= REPEAT_SHARE else GROUP_FREE_ESTIMATOR
    cmp = ">=" if share >= REPEAT_SHARE else "<"
    return EstimatorChoice(pick, f"auto: {repeated} of {n} rollouts share their task with another "
                                 f"({share:.0%} {cmp} {REPEAT_SHARE:.0%}), {len(sizes)} tasks")
