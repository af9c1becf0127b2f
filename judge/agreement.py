"""How well the judge agrees with a grader on the same rollouts: rank correlation and AUC. Pure.

- Spearman's rho: Pearson's correlation of the two rankings, ties given their average rank (the
  textbook definition, and scipy's). It asks whether the judge *orders* rollouts as the grader does,
  which is all a group-relative advantage uses.
- AUC on pass/fail: a rollout passes when the grader gave it at least ``threshold``; the AUC is the
  chance that a random passing rollout gets a higher judge score than a random failing one (ties count
  half; the Mann-Whitney U statistic over n_pass * n_fail). 0.5 is chance.

Both are None where they are undefined (fewer than two pairs, a constant ranking, one class only), never
a made-up number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def average_ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks from 1, tied values sharing the mean of the ranks they span."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of paired values; None when either side is constant or n < 2."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs pairs: {len(xs)} x values, {len(ys)} y values")
    if len(xs) < 2:
        return None
    rx, ry = average_ranks(xs), average_ranks(ys)
    dx, dy = rx - rx.mean(), ry - ry.mean()
    denom = float(np.sqrt((dx * dx).sum() * (dy * dy).sum()))
    return None if denom == 0 else float((dx * dy).sum() / denom)


def auc(scores: Sequence[float], passed: Sequence[bool]) -> float | None:
    """P(score of a passing rollout > score of a failing one), ties half; None with one class only."""
    pos = [s for s, p in zip(scores, passed) if p]
    neg = [s for s, p in zip(scores, passed) if not p]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@dataclass(frozen=True)
class Agreement:
    n: int  # rollouts scored by both
    n_pass: int
    spearman: float | None
    auc: float | None


def agreement(judge: Sequence[float], grader: Sequence[float], threshold: float = 0.5) -> Agreement:
    """The judge's agreement with a grader over the same rollouts (pass: grader value >= ``threshold``)."""
    passed = [g >= threshold for g in grader]
    return Agreement(len(judge), sum(passed), spearman(judge, grader), auc(judge, passed))
