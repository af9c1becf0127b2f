"""Simulated canary windows, the information bound, and binomial error bounds: what the canary rule is
measured with (``tests/loop/test_canary.py``, ``bench/canary.py``). Pure functions of a seeded generator.

A window is a stream of rollouts in arrival order: each goes to the candidate with probability ``share``
(the gateway's hash of a random rollout key) and scores 1 with its arm's success rate, the demo's task
success (Bernoulli). The reference for detection is the oracle sequential probability ratio test: told
both success rates, it bets on the arm of each rollout given its reward against the pooled rate (the
likelihood ratio whose mean growth, the mutual information between arm and reward, no test exceeds;
Wald and Wolfowitz: the SPRT needs the fewest rollouts on average at its error rates). When the oracle's
p90 is above a target, no valid rule that must learn the rates can meet it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loop.canary import PROMOTE, ROLL_BACK, WAIT, CanaryRule, evidence


def stream(
    rng: np.random.Generator, p_serving: float, p_candidate: float, share: float, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """One window of ``n`` rollouts: (is the candidate's, 0/1 reward)."""
    cand = rng.random(n) < share
    return cand, (rng.random(n) < np.where(cand, p_candidate, p_serving)).astype(float)


def ever_crosses(candidate: np.ndarray, rewards: np.ndarray, rule: CanaryRule) -> tuple[bool, bool]:
    """Whether the rollback and the promote evidence each ever reach 1/alpha at a look with enough rewards
    per arm, each on its own (stricter than the first decision, where one answer ends the window)."""
    ev = evidence(candidate, rewards, rule)
    threshold = math.log(1 / rule.alpha)
    return (
        bool(np.any(ev.enough & (ev.log_rollback >= threshold))),
        bool(np.any(ev.enough & (ev.log_promote >= threshold))),
    )


def oracle_first_rollback(
    candidate: np.ndarray,
    rewards: np.ndarray,
    p_serving: float,
    p_candidate: float,
    share: float,
    rule: CanaryRule,
) -> int:
    """Rollouts the oracle SPRT (module docstring) needs to roll back, with the rule's minimum per arm;
    len(rewards) if it never does."""
    cand = np.asarray(candidate, dtype=bool)
    x = np.asarray(rewards, dtype=float)
    p0 = share * p_candidate + (1 - share) * p_serving
    q1, q0 = share * p_candidate / p0, share * (1 - p_candidate) / (1 - p0)  # P(candidate | reward 1 / 0)
    q = np.where(x > 0, q1, q0)
    with np.errstate(divide="ignore"):
        log_lr = np.cumsum(np.log(np.where(cand, q / share, (1 - q) / (1 - share))))
    enough = (np.cumsum(cand) >= rule.min_per_arm) & (np.cumsum(~cand) >= rule.min_per_arm)
    hit = np.flatnonzero(enough & (log_lr >= math.log(1 / rule.alpha)))
    return int(hit[0]) + 1 if hit.size else x.size


def binomial_upper(k: int, m: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper bound on a rate seen k times in m trials."""
    if k >= m:
        return 1.0

    def cdf(p: float) -> float:  # P(X <= k) for X ~ Binomial(m, p)
        logs = [
            math.lgamma(m + 1)
            - math.lgamma(i + 1)
            - math.lgamma(m - i + 1)
            + i * math.log(p)
            + (m - i) * math.log1p(-p)
            for i in range(k + 1)
        ]
        top = max(logs)
        return math.exp(top) * sum(math.exp(v - top) for v in logs)

    lo, hi = k / m, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 1 - confidence else (lo, mid)
    return hi


@dataclass(frozen=True)
class Detection:
    """Rollouts to the first decision over many windows of one effect."""

    p_serving: float
    p_candidate: float
    needed: np.ndarray  # rollouts seen at each window's first decision (n when none)
    actions: list[str]
    oracle: np.ndarray  # the oracle SPRT's rollouts to roll back on the same windows

    def pct(self, q: float, oracle: bool = False) -> float:
        return float(np.percentile(self.oracle if oracle else self.needed, q))

    def share_of(self, action: str) -> float:
        return self.actions.count(action) / len(self.actions)

    def line(self) -> str:
        oracle = f"   oracle SPRT p50 {self.pct(50, True):4.0f}  p90 {self.pct(90, True):4.0f}"
        return (
            f"{self.p_serving:.2f} -> {self.p_candidate:.2f}: p50 {self.pct(50):4.0f}  p90 {self.pct(90):4.0f}  "
            f"rolled back {self.share_of(ROLL_BACK):.3f}  promoted {self.share_of(PROMOTE):.3f}  "
            f"undecided {self.share_of(WAIT):.3f}" + (oracle if self.p_candidate < self.p_serving else "")
        )


def detection(
    p_serving: float,
    p_candidate: float,
    rule: CanaryRule,
    first: Callable[[np.ndarray, np.ndarray, CanaryRule], tuple[int, str]],
    share: float = 0.2,
    runs: int = 2000,
    n: int = 1200,
    seed: int = 0,
) -> Detection:
    """``first`` (``loop.canary.first_decision``) over ``runs`` seeded windows of one effect, beside the oracle."""
    rng = np.random.default_rng(seed)
    needed, actions, oracle = [], [], []
    for _ in range(runs):
        c, x = stream(rng, p_serving, p_candidate, share, n)
        k, a = first(c, x, rule)
        needed.append(k)
        actions.append(a)
        oracle.append(oracle_first_rollback(c, x, p_serving, p_candidate, share, rule))
    return Detection(p_serving, p_candidate, np.array(needed), actions, np.array(oracle))


@dataclass(frozen=True)
class Calibration:
    """How often each wrong answer came, over ``runs`` windows at one success rate."""

    rate: float
    runs: int
    false_rollbacks: int  # an equal candidate's rollback evidence reached 1/alpha
    harmed: float | None  # the harmed candidate's rate (rate - margin), None when below 0
    false_promotes: int

    def line(self, alpha: float) -> str:
        rb = f"false rollbacks {self.false_rollbacks:4d}/{self.runs} (upper {binomial_upper(self.false_rollbacks, self.runs):.3f})"
        if self.harmed is None:
            return f"success {self.rate:.2f}: {rb}; a harm of the margin is below 0 here (alpha {alpha})"
        pr = f"false promotes of {self.harmed:.2f} {self.false_promotes:4d}/{self.runs} (upper {binomial_upper(self.false_promotes, self.runs):.3f})"
        return f"success {self.rate:.2f}: {rb}; {pr} (alpha {alpha})"


def calibration(
    rate: float, rule: CanaryRule, share: float = 0.2, runs: int = 2000, n: int = 1200, seed: int = 0
) -> Calibration:
    """Equal arms at ``rate`` (a rollback is wrong) and a candidate worse by the margin (a promote is
    wrong), each test on its own with a look after every rollout."""
    rng = np.random.default_rng(seed)
    harmed = round(rate - rule.margin, 10)
    rollbacks = sum(ever_crosses(*stream(rng, rate, rate, share, n), rule)[0] for _ in range(runs))
    if harmed < 0:
        return Calibration(rate, runs, rollbacks, None, 0)
    promotes = sum(ever_crosses(*stream(rng, rate, harmed, share, n), rule)[1] for _ in range(runs))
    return Calibration(rate, runs, rollbacks, harmed, promotes)
