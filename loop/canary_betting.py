"""A canary test that trusts only the reward bounds: testing by betting, measured against ``loop.canary``.

Why it exists: the default rule (``loop.canary``, the mSPRT) plugs each arm's sample variance into a
normal mixture, so its error guarantee is asymptotic; a small candidate arm of 0/1 rewards that scores
low by chance also estimates a low variance. This rule needs no variance estimate to be valid: rewards
lie in ``rule.reward_range`` and the gateway assigns each rollout to the candidate with a known
probability ``share``, so the inverse-propensity increment

    z_i = c_i (x_i - b_i) / share - (1 - c_i) (x_i - b_i) / (1 - share)      (c_i = 1 on the candidate arm)

is bounded, with conditional mean exactly Delta = mean(candidate) - mean(serving) given the past, for any
baseline ``b_i`` fixed before rollout i is assigned (the pooled mean reward of the rollouts before it: the
centring cuts the candidate success's jump from 1/share to (1 - b)/share, so the bets can be larger).
Two test supermartingales bet on it (Waudby-Smith and Ramdas, "Estimating means of bounded random
variables by betting", JRSS-B 2023; Shafer and Vovk's testing by betting):

* **roll back** when the capital of betting *against* H0: Delta >= 0, prod (1 - l_i z_i), reaches 1/alpha;
* **promote** when the capital of betting against H0: Delta <= -margin, prod (1 + l_i (z_i + margin)),
  reaches 1/alpha.

Each factor has mean <= 1 under its null and stays >= 0 (``l_i`` is capped below the bound), so by
Ville's inequality each wrong answer has probability <= alpha over every look at once, for any sample
size, without the central limit theorem. ``l_i`` is aGRAPA (the approximate growth-rate-adaptive bet:
past mean over past second moment, from rollouts before i only, so the bet is predictable).

Measured (``tests/loop/test_canary.py``, 1,000 seeded streams, a look after every rollout, share 0.2,
success 0.25 -> 0.05): the printed figures are in the test's log; in the run that chose these settings
it rolled back after median 136, p90 277 rollouts, against the mSPRT's 122 / 231 on the same streams,
with false rollbacks of an equal candidate 0.027 (the mSPRT's 0.045), and it promoted a better candidate
(0.25 -> 0.45) sooner (p90 393 against 408). Uncentred (b = 0) it took 184 / 299; a mixture over eight bet
sizes instead of aGRAPA 160 / 303. The cost of validity without a variance estimate: a candidate success
moves z by about (1 - b)/share = 3.75 reward units, so the bet against it must stay below 1/3.75, which caps
how fast the capital can grow. Slower on the harm at p90, so it is not the default.
It needs the rollouts in arrival order and the share: ``tracerl promote --once --betting-share F``
(``decide_by_betting``) reads each arm's rewarded rollouts of the window in the order they began, and F
is the gateway's ``--canary`` share. The guarantee assumes the order of a look extends the previous
look's; a rollout rewarded late that began before rewarded ones is placed where it began, which bends
that assumption a little (rewards that arrive in order keep it exact).
"""

from __future__ import annotations

import math

import numpy as np

from loop.canary import PROMOTE, ROLL_BACK, WAIT, CanaryDecision, CanaryRule

BET_CAP = 0.7  # the fraction of the largest safe bet used (WSR's truncation): measured p90 0.5: 276, 0.7: 277, 0.9: 369


def ipw_increments(
    candidate: np.ndarray, rewards: np.ndarray, share: float, rule: CanaryRule
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each rollout's unbiased increment for Delta (module docstring), rewards rescaled to [0, 1], centred
    on the pooled mean of the rollouts before it; -> (z, the largest and the smallest z could have been)."""
    if not 0 < share < 1:
        raise ValueError(f"share {share} must be in (0, 1): the gateway's --canary fraction")
    lo, hi = rule.reward_range
    x = (np.asarray(rewards, dtype=float) - lo) / (hi - lo)
    if x.size and (x.min() < -1e-9 or x.max() > 1 + 1e-9):
        raise ValueError(f"rewards outside reward_range [{lo:g}, {hi:g}]; pass the range the rewards live in")
    t = np.arange(1, x.size + 1)
    b = np.concatenate([[0.5], np.cumsum(x)[:-1] / t[:-1]])  # predictable: rollouts before i only
    z = np.where(np.asarray(candidate, dtype=bool), (x - b) / share, -(x - b) / (1 - share))
    return z, np.maximum((1 - b) / share, b / (1 - share)), np.minimum(-b / share, -(1 - b) / (1 - share))


def log_capital(y: np.ndarray, max_bet: float | np.ndarray) -> np.ndarray:
    """log of prod (1 + l_i y_i) after each i, with the predictable aGRAPA bet ``l_i`` in [0, max_bet_i]."""
    y = np.asarray(y, dtype=float)
    t = np.arange(1, y.size + 1)
    past_mean = np.concatenate([[0.0], np.cumsum(y)[:-1] / t[:-1]])
    past_m2 = np.concatenate([[1.0], np.cumsum(y * y)[:-1] / t[:-1]])
    bet = np.clip(past_mean / np.maximum(past_m2, 1e-12), 0.0, max_bet)
    return np.cumsum(np.log1p(bet * y))


def betting_codes(candidate: np.ndarray, rewards: np.ndarray, share: float, rule: CanaryRule) -> np.ndarray:
    """The decision after every rollout of one stream: 1 promote, -1 roll back, 0 wait."""
    cand = np.asarray(candidate, dtype=bool)
    z, z_max, z_min = ipw_increments(cand, rewards, share, rule)
    m = rule.margin / (rule.reward_range[1] - rule.reward_range[0])
    threshold = math.log(1 / rule.alpha)
    # factors >= 0: 1 - l z needs l <= 1 / z_max; 1 + l (z + m) needs l <= 1 / (-z_min - m)
    rollback = log_capital(-z, BET_CAP / z_max) >= threshold
    promote = log_capital(z + m, BET_CAP / (-z_min - m)) >= threshold
    # a supermartingale that once crossed stays decided (Ville: the first crossing is the test)
    rollback, promote = np.maximum.accumulate(rollback), np.maximum.accumulate(promote)
    enough = (np.cumsum(cand) >= rule.min_per_arm) & (np.cumsum(~cand) >= rule.min_per_arm)
    return np.where(enough, np.where(promote, 1, np.where(rollback, -1, 0)), 0)


def betting_first_decision(
    candidate: np.ndarray, rewards: np.ndarray, share: float, rule: CanaryRule | None = None
) -> tuple[int, str]:
    """Like ``loop.canary.first_decision``: (rollouts seen at the first decision, action), or (len, WAIT)."""
    code = betting_codes(candidate, rewards, share, rule or CanaryRule())
    hit = np.flatnonzero(code)
    if hit.size == 0:
        return len(code), WAIT
    i = int(hit[0])
    return i + 1, PROMOTE if code[i] > 0 else ROLL_BACK


def decide_by_betting(
    candidate: np.ndarray, rewards: np.ndarray, share: float, rule: CanaryRule | None = None
) -> CanaryDecision:
    """The decision over the window's rollouts in arrival order (``candidate[i]``: rollout i's arm), as
    ``loop.canary.decide`` reports it: the first test to cross 1/alpha decides, and stays decided."""
    rule = rule or CanaryRule()
    cand = np.asarray(candidate, dtype=bool)
    x = np.asarray(rewards, dtype=float)
    n_c, n_s = int(cand.sum()), int((~cand).sum())
    mean_c = float(x[cand].mean()) if n_c else 0.0
    mean_s = float(x[~cand].mean()) if n_s else 0.0
    nan = float("nan")
    numbers = (n_s, n_c, mean_s, mean_c, mean_c - mean_s, nan, nan)
    if min(n_s, n_c) < rule.min_per_arm:
        why = f"{n_s} serving and {n_c} candidate rewards; each arm needs {rule.min_per_arm}"
        return CanaryDecision(WAIT, *numbers, why)
    code = betting_codes(cand, x, share, rule)
    hit = np.flatnonzero(code)
    if hit.size == 0:
        return CanaryDecision(
            WAIT, *numbers, f"neither bet reached 1/alpha = {1 / rule.alpha:g} (share {share:g})"
        )
    i = int(hit[0])
    if code[i] > 0:
        why = f"the bet against a loss of margin {rule.margin:g} reached 1/alpha at rollout {i + 1}"
        return CanaryDecision(PROMOTE, *numbers, why)
    why = f"the bet against 'no worse' reached 1/alpha at rollout {i + 1}: the candidate is worse"
    return CanaryDecision(ROLL_BACK, *numbers, why)
