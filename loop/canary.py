"""The canary decision: promote policy@k+1, roll it back, or wait for more rollouts.

A candidate (``policy@k+1``) serves a share of live rollouts beside the serving version (``policy@k``);
this module compares the two arms' rewards over the same window, in the order the rollouts began, and
says what to do. It is a pure function of that sequence, so ``tracerl promote --once`` recomputes it
from the store on every run, and a trainer killed between canary and decision resumes by running it again.

Why sequential and exact: cron decides whenever it runs, as often as it runs. A fixed-sample test
checked after every rollout ("peeking") inflates its error far past alpha; an always-valid one does not.
The mixture SPRT this module used before (Johari et al., "Always Valid Inference", 2022) plugs each arm's
sample variance into a normal mixture, so its guarantee is asymptotic, and at low success rates it broke:
equal arms at success 0.05 were rolled back 0.062 of the time and at 0.1 0.085 (alpha 0.05). The rule
here needs nothing but the reward bounds: each wrong answer has probability <= alpha over every look at
once, at any sample size and any success rate (Ville's inequality on a nonnegative supermartingale).

**Paired blocks.** The candidate's j-th rollout is paired with the next ``m_j`` serving rollouts, where
``m_j`` is the arms' ratio seen before it (rounded, 1..``MAX_RATIO``: 4 at a 0.2 share). Blocks are cut by
the arms alone, and the gateway assigns arms by a hash of the rollout key, independent of how a rollout
goes, so given the arms the blocks' rewards are independent, with means ``mu_c`` (candidate) and ``mu_s``
(serving). A block is used once all its rollouts have a reward; a look sees the blocks completed by then.
The share need not be known, nor constant over the window.

**Roll back** when the evidence against H0: ``mu_c >= mu_s`` (the candidate is no worse) reaches
1/alpha. The evidence is the product over blocks of the two-sample likelihood ratio of Turner, Ly and
Grünwald ("Generic E-variables for exact sequential k-sample tests that allow for optional stopping",
J. Stat. Plan. Inference 230, 2024): the alternative's success rates ``(a, b)``, estimated from earlier
blocks only (so the bet is predictable), against the block's pooled rate ``p0 = (a + m b)/(1 + m)``; their
theorem makes its mean <= 1 under every ``mu_c = mu_s``, and with ``a <= b`` a better candidate only
lowers it, so under the whole null. A reward in [0, 1] that is not 0/1 enters through the linear
likelihood ``L_p(x) = p x + (1 - p)(1 - x)``: the block's factor is then linear in each reward, so its
mean depends on the rewards' means alone and the Bernoulli case bounds it (exact for bounded rewards).
This ratio's growth under the alternative is the mutual information between arm and reward, the best
any test can have (``tests/loop/test_canary.py`` prints the bound).

**Promote** when the evidence against H0: ``mu_c <= mu_s - margin`` (the candidate costs at least the
margin) reaches 1/alpha: a bet on each block's difference ``d_j = x_c - mean(x_s)``, a bounded variable
with mean ``mu_c - mu_s``, against ``d_j + margin <= 0`` in mean (Waudby-Smith and Ramdas, "Estimating
means of bounded random variables by betting", JRSS-B 2023; the aGRAPA bet, capped at ``BET_CAP`` of the
largest safe one).

No decision before each arm has ``min_per_arm`` rewarded rollouts; the first crossing decides, and
stays decided. Between a harm of the margin and no harm at all, either answer is acceptable.

Measured (``python bench/canary.py``; share 0.2, 2,000 seeded windows per line, a look after every
rollout): false rollbacks of an equal candidate 0.015-0.029 and false promotes of a harm of the margin
0.002-0.034 at success rates 0.02 to 0.9 (every one-sided 95% upper bound <= 0.041 < alpha). Detection of
a harmed checkpoint: 0.25 -> 0 (the demo's trained success against a candidate at ~0) p50 106, p90 137
rollouts (the oracle SPRT, told both rates: 99 / 126); 0.25 -> 0.05 p50 151, p90 332, where the oracle
needs p90 231: a p90 of 200 at that smaller harm is below the information bound, no valid test reaches
it. A candidate merely equal to serving is promoted slowly, and no valid test can do much better: telling
"no worse" from "worse by the margin" is a small effect (at success 0.25, share 0.2 and margin 0.05 the
information bound is about 2,650 rollouts on average; within 1,200 rollouts 0.15 of equal candidates are
promoted, the rest wait); a wider ``--margin`` or a larger share is the lever. Rewards strictly between 0 and 1 are handled exactly but conservatively (the linear likelihood bets
as if each were a coin of that bias). Alternatives measured on the same windows before this one was
chosen (p90 at 0.25 -> 0 / 0.25 -> 0.05): betting on inverse-propensity increments with the share known
143 / 280; a bet on the blocks' differences alone (aGRAPA) for both sides 162 / 289; this 141 / 315;
the oracle 128 / 237. The first needs the gateway's share, exactly, at every look; this one needs no share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PROMOTE = "promote"
ROLL_BACK = "rollback"
WAIT = "wait"

MAX_RATIO = 9  # the most serving rollouts paired with one candidate rollout (a share down to 0.1)
PRIOR = 2.0  # pseudo-rollouts at the pooled rate in each arm's estimate: p90 at 0.25 -> 0: 141 (8: 166)
EPS = 1e-3  # estimated rates stay in [EPS, 1 - EPS], so every factor is finite
BET_CAP = 0.7  # the share of the largest safe bet the promote side uses (WSR's truncation)


@dataclass(frozen=True)
class CanaryRule:
    """How the canary is judged; ``margin`` in reward units."""

    alpha: float = 0.05  # the chance of each wrong answer (module docstring), over all looks
    margin: float = 0.05  # the loss of mean reward a release may cost and still be promoted
    min_per_arm: int = 20  # no decision before each arm has this many rewarded rollouts
    reward_range: tuple[float, float] = (0.0, 1.0)  # rewards lie in [lo, hi]

    def __post_init__(self) -> None:
        lo, hi = self.reward_range
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha {self.alpha} must be in (0, 1), e.g. 0.05")
        if not hi > lo:
            raise ValueError(f"reward_range {self.reward_range} must be (lo, hi) with hi > lo")
        if not 0 <= self.margin < hi - lo:
            raise ValueError(
                f"margin {self.margin} must be >= 0 and below the reward range's width {hi - lo:g} "
                "(a loss of mean reward)"
            )
        if self.min_per_arm < 1:
            raise ValueError(f"min_per_arm {self.min_per_arm} must be >= 1")


@dataclass(frozen=True)
class CanaryDecision:
    """The decision and the numbers behind it (what the rounds manifest and ``report`` show)."""

    action: str  # PROMOTE, ROLL_BACK or WAIT
    n_serving: int
    n_candidate: int
    mean_serving: float
    mean_candidate: float
    diff: float  # mean_candidate - mean_serving
    e_rollback: float  # the largest evidence so far against "no worse" (rolls back at 1/alpha)
    e_promote: float  # the largest evidence so far against "a loss of the margin" (promotes at 1/alpha)
    blocks: int  # paired blocks complete at this look
    reason: str


@dataclass(frozen=True)
class Blocks:
    """The window cut into paired blocks (module docstring), rewards rescaled to [0, 1]."""

    candidate: np.ndarray  # [J] the candidate rollout's reward
    serving: np.ndarray  # [sum m] the serving rewards of all blocks, block by block
    m: np.ndarray  # [J] serving rollouts in each block
    done_at: np.ndarray  # [J] index of the rollout that completed each block

    @property
    def serving_mean(self) -> np.ndarray:
        sums = np.bincount(np.repeat(np.arange(self.m.size), self.m), self.serving, minlength=self.m.size)
        return sums / np.maximum(self.m, 1)


def unit_rewards(rewards: np.ndarray, rule: CanaryRule) -> np.ndarray:
    """Rewards rescaled from ``rule.reward_range`` to [0, 1]; a reward outside the range names the fix."""
    lo, hi = rule.reward_range
    x = (np.asarray(rewards, dtype=float) - lo) / (hi - lo)
    if x.size and (x.min() < -1e-9 or x.max() > 1 + 1e-9):
        raise ValueError(
            f"rewards from {x.min() * (hi - lo) + lo:g} to {x.max() * (hi - lo) + lo:g} lie outside "
            f"reward_range [{lo:g}, {hi:g}]; pass the range the rewards live in"
        )
    return np.clip(x, 0.0, 1.0)


def paired_blocks(candidate: np.ndarray, x: np.ndarray) -> Blocks:
    """Cut a window (arrival order; ``candidate[i]``: rollout i's arm) into paired blocks, by the arms alone."""
    cand = np.asarray(candidate, dtype=bool)
    ci, si = np.flatnonzero(cand), np.flatnonzero(~cand)
    seen = np.searchsorted(si, ci)  # serving rollouts that arrived before each candidate rollout
    m = np.clip(np.rint((seen + 1) / (np.arange(ci.size) + 1)), 1, MAX_RATIO).astype(int)
    end = np.cumsum(m)
    keep = end <= si.size  # a prefix: the blocks whose serving rollouts have all arrived
    ci, m, end = ci[keep], m[keep], end[keep]
    used = si[: int(end[-1])] if end.size else si[:0]
    done_at = np.maximum(ci, si[end - 1]) if end.size else ci
    return Blocks(x[ci], x[used], m, done_at)


def _linear_log_lik(p: np.ndarray, x: np.ndarray) -> np.ndarray:
    """log L_p(x), L_p(x) = p x + (1 - p)(1 - x): the Bernoulli likelihood, linear in x on [0, 1]."""
    return np.log(p * x + (1 - p) * (1 - x))


def rollback_log_e(b: Blocks) -> np.ndarray:
    """log of the evidence against "the candidate is no worse" after each block (module docstring)."""
    j = np.arange(b.m.size)
    block_sum = np.bincount(np.repeat(j, b.m), b.serving, minlength=j.size)
    before = lambda v: np.concatenate([[0.0], np.cumsum(v)[:-1]])  # noqa: E731 (earlier blocks only)
    c_sum, s_sum, s_n = before(b.candidate), before(block_sum), before(b.m)
    pool = (c_sum + s_sum + 0.5) / (j + s_n + 1)
    a = np.clip((c_sum + PRIOR * pool) / (j + PRIOR), EPS, 1 - EPS)
    s_rate = np.clip((s_sum + PRIOR * pool) / (s_n + PRIOR), EPS, 1 - EPS)
    a = np.minimum(a, s_rate)  # bet only on a worse candidate: a better one has mean factor <= 1
    p0 = (a + b.m * s_rate) / (1 + b.m)
    per_serving = np.repeat(j, b.m)
    serving_term = np.bincount(
        per_serving,
        _linear_log_lik(s_rate[per_serving], b.serving) - _linear_log_lik(p0[per_serving], b.serving),
        minlength=j.size,
    )
    return np.cumsum(_linear_log_lik(a, b.candidate) - _linear_log_lik(p0, b.candidate) + serving_term)


def log_capital(y: np.ndarray, max_bet: float) -> np.ndarray:
    """log of prod (1 + l_i y_i) after each i, with the predictable aGRAPA bet ``l_i`` in [0, max_bet]
    (past mean over past second moment: the growth-rate-optimal bet to second order)."""
    y = np.asarray(y, dtype=float)
    t = np.arange(1, y.size + 1)
    past_mean = np.concatenate([[0.0], np.cumsum(y)[:-1] / t[:-1]])
    past_m2 = np.concatenate([[1.0], np.cumsum(y * y)[:-1] / t[:-1]])
    bet = np.clip(past_mean / np.maximum(past_m2, 1e-12), 0.0, max_bet)
    return np.cumsum(np.log1p(bet * y))


def promote_log_e(b: Blocks, margin: float) -> np.ndarray:
    """log of the evidence against "the candidate costs ``margin`` or more" (unit rewards) after each block:
    d + margin lies in [-1 + margin, 1 + margin], so a bet below 1 / (1 - margin) keeps every factor > 0."""
    return log_capital(b.candidate - b.serving_mean + margin, BET_CAP / (1 - margin))


@dataclass(frozen=True)
class Evidence:
    """The window's evidence after each paired block, and what a look would decide on it."""

    blocks: Blocks
    log_rollback: np.ndarray  # [J] log of the largest rollback evidence so far (a crossing stays)
    log_promote: np.ndarray  # [J] the same for promote
    enough: np.ndarray  # [J] some look sees block j's evidence while each arm has min_per_arm rewards
    code: np.ndarray  # [J] 1 promote / -1 roll back / 0 wait, at the first such look
    at: np.ndarray  # [J] that look: the rollout after which it comes (block done and each arm at the minimum)


def evidence(candidate: np.ndarray, rewards: np.ndarray, rule: CanaryRule) -> Evidence:
    """Both evidences over the window's paired blocks; a block's evidence decides at the first look that
    sees it while each arm has ``min_per_arm`` rewarded rollouts (all of the window's, used in a block or not)."""
    cand = np.asarray(candidate, dtype=bool)
    b = paired_blocks(cand, unit_rewards(rewards, rule))
    lo, hi = rule.reward_range
    e_rb = np.maximum.accumulate(rollback_log_e(b)) if b.m.size else np.zeros(0)
    e_pr = np.maximum.accumulate(promote_log_e(b, rule.margin / (hi - lo))) if b.m.size else np.zeros(0)
    threshold = math.log(1 / rule.alpha)
    both = np.flatnonzero((np.cumsum(cand) >= rule.min_per_arm) & (np.cumsum(~cand) >= rule.min_per_arm))
    t_enough = int(both[0]) if both.size else cand.size
    shown_until = np.append(b.done_at[1:], cand.size)  # block j's evidence is the latest until block j+1
    enough = t_enough < shown_until
    code = np.where(enough, np.where(e_pr >= threshold, 1, np.where(e_rb >= threshold, -1, 0)), 0)
    return Evidence(b, e_rb, e_pr, enough, code, np.maximum(b.done_at, t_enough))


def decide(candidate: np.ndarray, rewards: np.ndarray, rule: CanaryRule = CanaryRule()) -> CanaryDecision:
    """Promote, roll back or wait, from the window's rewarded rollouts in the order they began
    (``candidate[i]``: whether rollout i ran on the candidate)."""
    cand = np.asarray(candidate, dtype=bool)
    x = np.asarray(rewards, dtype=float)
    unit_rewards(x, rule)  # a reward outside the range is an error even while waiting
    n_c, n_s = int(cand.sum()), int((~cand).sum())
    mean_c = float(x[cand].mean()) if n_c else 0.0
    mean_s = float(x[~cand].mean()) if n_s else 0.0
    ev = evidence(cand, x, rule)
    b, code, e_rb, e_pr = ev.blocks, ev.code, ev.log_rollback, ev.log_promote
    hit = np.flatnonzero(code)
    k = int(hit[0]) if hit.size else b.m.size - 1  # the deciding block, or the last one
    e = (math.exp(e_rb[k]), math.exp(e_pr[k])) if b.m.size else (1.0, 1.0)
    numbers = (n_s, n_c, mean_s, mean_c, mean_c - mean_s, *e, int(b.m.size))
    need = 1 / rule.alpha
    if min(n_s, n_c) < rule.min_per_arm:
        why = f"{n_s} serving and {n_c} candidate rewards; each arm needs {rule.min_per_arm}"
        return CanaryDecision(WAIT, *numbers, why)
    if not hit.size:
        why = f"evidence {e[0]:.3g} (worse) and {e[1]:.3g} (no worse) after {b.m.size} paired blocks; either needs {need:g}"
        return CanaryDecision(WAIT, *numbers, why)
    if code[k] > 0:
        why = f"evidence {e[1]:.3g} >= 1/alpha = {need:g} against a loss of margin {rule.margin:g}, at block {k + 1}"
        return CanaryDecision(PROMOTE, *numbers, why)
    why = f"evidence {e[0]:.3g} >= 1/alpha = {need:g} against 'no worse', at block {k + 1}: the candidate is worse"
    return CanaryDecision(ROLL_BACK, *numbers, why)


def first_decision(candidate: np.ndarray, rewards: np.ndarray, rule: CanaryRule) -> tuple[int, str]:
    """Replay one stream in arrival order with a look after every rollout; -> (rollouts seen when the
    first decision came, action), or (len, WAIT). The worst case for peeking (tests, bench)."""
    ev = evidence(candidate, rewards, rule)
    hit = np.flatnonzero(ev.code)
    if hit.size == 0:
        return len(np.asarray(rewards)), WAIT
    i = int(hit[0])
    return int(ev.at[i]) + 1, PROMOTE if ev.code[i] > 0 else ROLL_BACK
