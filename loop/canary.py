"""The canary decision: promote policy@k+1, roll it back, or wait for more rollouts.

A candidate (``policy@k+1``) serves a share of live rollouts beside the serving version
(``policy@k``); this module compares the two arms' rewards over the same window and says what to do.
It is a pure function of the arms' sufficient statistics (count, mean, variance), so
``tracerl promote --once`` recomputes it from the store on every run and a trainer killed between
canary and decision resumes by running it again.

The test: the mixture sequential probability ratio test (mSPRT) for a difference of means, as
Johari, Koomen, Pekelis and Walsh define it for A/B tests ("Peeking at A/B Tests", KDD 2017;
"Always Valid Inference", Operations Research 70(3), 2022), used as its always-valid confidence
sequence. With Delta = mean(candidate) - mean(serving), its estimate ``d`` and ``V = s_c^2/n_c +
s_s^2/n_s``, mixing the alternative over N(Delta, tau^2) gives, at every sample size at once,

    |d - Delta| <= r,   r^2 = V (V + tau^2) / tau^2 * (2 log(1/alpha) + log((V + tau^2) / V))

with probability at least 1 - alpha (Robbins' normal mixture; Howard, Ramdas, McAuliffe and
Sekhon, "Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist. 2021,
call it the normal-mixture boundary). Why this one: the decision is taken by cron, whenever it
runs, as often as it runs; a fixed-sample test checked repeatedly ("peeking") inflates its error
far past alpha, an always-valid one does not, and it needs no planned number of looks (a
group-sequential design's alpha spending does) and no pairing of the arms' rollouts (Wald's
two-sample SPRT does), which arrive at 1:4 under a 0.2 share.

The decision, with ``margin`` the loss of mean reward a release may cost:

* **promote** when ``d - r > -margin``: the candidate is no worse than serving minus the margin;
* **roll back** when ``d + r < 0`` (and it cannot be promoted): the candidate is worse than serving;
* **wait** otherwise, or while either arm has fewer than ``min_per_arm`` rewards.

Error guarantees (each over the whole unbounded sequence of looks): a candidate that truly costs
``margin`` or more is promoted with probability at most alpha; one that is truly no worse than
serving (Delta >= 0) is rolled back with probability at most alpha. Between those (a small loss
inside the margin) either answer is acceptable. Each arm's variance is estimated (the mSPRT's
plug-in, as Johari et al. run it in production), so the guarantee is asymptotic (the central limit
theorem); to keep small arms of 0/1 rewards from claiming a zero variance, each estimate is shrunk
with one pseudo-observation at the largest variance a reward in ``reward_range`` can have.
``tests/loop/test_canary.py`` measures the false rollback rate by Monte Carlo, checked every
rollout (the worst case for peeking).

``tau`` is the size of effect the test is tuned to find fastest (Johari et al. set it from past
experiments' effects); the default, 0.1 on a 0..1 reward, suits a harmful round's collapse.

Detection, measured (1,000 seeded streams each, a look after every rollout, share 0.2, the demo's
scale: success 0.25 -> 0.05; false rollbacks: a candidate equal to serving at 0.25):

    rule                                   rollouts to roll back   false rollbacks
    two-sided, tau 0.1, min 20 (default)   median 124, p90 244     0.042
    two-sided, tau 0.2 or 0.25, min 20     median 118, p90 233-235 0.041
    one-sided (half-normal mixture), tau 0.2, min 20   median 113, p90 204   0.065
    one-sided, tau 0.2, min 30             median 157, p90 219     0.052
    betting on bounded rewards (loop/canary_betting.py), min 20   median 136, p90 277   0.027

(the betting line and the default's beside it on the same other 1,000 streams: median 122, p90 231,
false rollbacks 0.045.) The betting rule needs no variance estimate (valid at every sample size, from the
reward bounds and the known share alone); the default's plug-in guarantee does not hold at low success
rates: equal arms at 0.05 are rolled back 0.062 of the time, at 0.1 0.085 (above alpha), where the
betting rule's are 0.030 and 0.032. It is slower on the harm at p90 (277 against 231), so it is not the
default: neither is better on both. ``tests/loop/test_canary.py`` prints all of these.

The one-sided boundary is the closest to a p90 of 200 rollouts but rolls a good candidate back more
often than alpha: with 20 rewards of 0/1 at 0.25, a candidate arm that is low by chance also
estimates a low variance (the plug-in's small-sample bias), which the two-sided boundary's extra
width absorbs. So the default stays two-sided; a p90 of 200 needs alpha 0.1 or a larger share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PROMOTE = "promote"
ROLL_BACK = "rollback"
WAIT = "wait"


@dataclass(frozen=True)
class CanaryRule:
    """How the canary is judged; every field in reward units unless said."""

    alpha: float = 0.05  # the chance of each wrong answer (module docstring), over all looks
    margin: float = 0.05  # the loss of mean reward a release may cost and still be promoted
    min_per_arm: int = 20  # no decision before each arm has this many rewarded rollouts
    tau: float = 0.1  # the mixture's scale: the effect size detected fastest
    reward_range: tuple[float, float] = (0.0, 1.0)  # rewards lie in [lo, hi] (bounds the variance)

    def __post_init__(self) -> None:
        lo, hi = self.reward_range
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha {self.alpha} must be in (0, 1), e.g. 0.05")
        if self.margin < 0:
            raise ValueError(f"margin {self.margin} must be >= 0 (a loss of mean reward)")
        if self.min_per_arm < 2:
            raise ValueError(f"min_per_arm {self.min_per_arm} must be >= 2 (a variance needs two)")
        if self.tau <= 0:
            raise ValueError(f"tau {self.tau} must be > 0, e.g. the smallest harm worth catching")
        if not hi > lo:
            raise ValueError(f"reward_range {self.reward_range} must be (lo, hi) with hi > lo")

    @property
    def max_var(self) -> float:
        """The largest variance a reward in ``reward_range`` can have (half at each end)."""
        lo, hi = self.reward_range
        return ((hi - lo) / 2) ** 2


@dataclass(frozen=True)
class ArmStats:
    """One arm's rewards over the window: count, mean and sample variance (what SQL's
    ``count``, ``avg`` and ``var_samp`` return)."""

    n: int
    mean: float
    var: float

    @classmethod
    def of(cls, rewards: Sequence[float]) -> ArmStats:
        x = np.asarray(rewards, dtype=float)
        if x.size == 0:
            return cls(0, 0.0, 0.0)
        return cls(int(x.size), float(x.mean()), float(x.var(ddof=1)) if x.size > 1 else 0.0)


@dataclass(frozen=True)
class CanaryDecision:
    """The decision and the numbers behind it (what the rounds manifest and ``report`` show)."""

    action: str  # PROMOTE, ROLL_BACK or WAIT
    n_serving: int
    n_candidate: int
    mean_serving: float
    mean_candidate: float
    diff: float  # mean_candidate - mean_serving
    lower: float  # the always-valid confidence bounds on the true difference (nan while waiting on n)
    upper: float
    reason: str


def shrunk_var(n: np.ndarray, var: np.ndarray, max_var: float) -> np.ndarray:
    """Sample variance shrunk by one pseudo-observation at ``max_var`` (module docstring)."""
    n = np.asarray(n, dtype=float)
    return (np.maximum(n - 1, 0) * np.asarray(var, dtype=float) + max_var) / np.maximum(n, 1)


def radius(v: np.ndarray, rule: CanaryRule) -> np.ndarray:
    """The normal-mixture confidence sequence's half-width for an estimate of variance ``v``."""
    t2 = rule.tau**2
    return np.sqrt(v * (v + t2) / t2 * (2 * math.log(1 / rule.alpha) + np.log((v + t2) / v)))


def actions(
    n_s: np.ndarray,
    mean_s: np.ndarray,
    var_s: np.ndarray,
    n_c: np.ndarray,
    mean_c: np.ndarray,
    var_c: np.ndarray,
    rule: CanaryRule,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised decision over many looks: (action codes 1 promote / -1 roll back / 0 wait, lower, upper)."""
    v = shrunk_var(n_s, var_s, rule.max_var) / np.maximum(n_s, 1) + shrunk_var(
        n_c, var_c, rule.max_var
    ) / np.maximum(n_c, 1)
    d = np.asarray(mean_c, dtype=float) - np.asarray(mean_s, dtype=float)
    r = radius(v, rule)
    lower, upper = d - r, d + r
    enough = (np.asarray(n_s) >= rule.min_per_arm) & (np.asarray(n_c) >= rule.min_per_arm)
    code = np.where(lower > -rule.margin, 1, np.where(upper < 0, -1, 0))
    return np.where(enough, code, 0), lower, upper


def decide(serving: ArmStats, candidate: ArmStats, rule: CanaryRule = CanaryRule()) -> CanaryDecision:
    """Promote, roll back or wait, from the two arms' rewards over the same window."""
    lo, hi = rule.reward_range
    for name, arm in (("serving", serving), ("candidate", candidate)):
        if arm.n and not lo - 1e-9 <= arm.mean <= hi + 1e-9:
            raise ValueError(
                f"the {name} arm's mean reward {arm.mean:g} is outside reward_range [{lo:g}, {hi:g}]; "
                "pass the range the rewards live in"
            )
    code, lower, upper = (
        float(a)
        for a in actions(
            np.array(serving.n),
            np.array(serving.mean),
            np.array(serving.var),
            np.array(candidate.n),
            np.array(candidate.mean),
            np.array(candidate.var),
            rule,
        )
    )
    diff = candidate.mean - serving.mean
    if min(serving.n, candidate.n) < rule.min_per_arm:
        action, reason = (
            WAIT,
            (f"{serving.n} serving and {candidate.n} candidate rewards; each arm needs {rule.min_per_arm}"),
        )
    elif code > 0:
        action, reason = PROMOTE, f"lower bound {lower:+.3f} > -margin {-rule.margin:+.3f}"
    elif code < 0:
        action, reason = ROLL_BACK, f"upper bound {upper:+.3f} < 0: the candidate is worse"
    else:
        action, reason = WAIT, f"bounds [{lower:+.3f}, {upper:+.3f}] decide neither"
    return CanaryDecision(
        action, serving.n, candidate.n, serving.mean, candidate.mean, diff, lower, upper, reason
    )


def first_decision(candidate: np.ndarray, rewards: np.ndarray, rule: CanaryRule) -> tuple[int, str]:
    """Replay one stream of rollouts in arrival order (``candidate[i]``: the arm of rollout i),
    deciding after every rollout; -> (rollouts seen when the first decision came, action), or
    (len, WAIT). The worst case for peeking, since cron may look after any rollout."""
    cand = np.asarray(candidate, dtype=bool)
    x = np.asarray(rewards, dtype=float)
    stats = []
    for arm in (~cand, cand):
        n = np.cumsum(arm)
        s = np.cumsum(np.where(arm, x, 0.0))
        ss = np.cumsum(np.where(arm, x * x, 0.0))
        nn = np.maximum(n, 1)
        mean = s / nn
        var = np.where(n > 1, (ss - nn * mean**2) / np.maximum(n - 1, 1), 0.0)
        stats += [n, mean, np.maximum(var, 0.0)]
    code, _, _ = actions(*stats, rule)
    hit = np.flatnonzero(code)
    if hit.size == 0:
        return len(x), WAIT
    i = int(hit[0])
    return i + 1, PROMOTE if code[i] > 0 else ROLL_BACK
