"""The canary decision on simulated reward streams (seeded), checked after every rollout."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from loop.canary import PROMOTE, ROLL_BACK, WAIT, CanaryRule, decide, evidence, first_decision
from loop.canary_sim import binomial_upper, calibration, detection, stream

RULE = CanaryRule()


@pytest.mark.parametrize("rate", [0.02, 0.05, 0.1, 0.3, 0.5, 0.9])
def test_each_wrong_answer_stays_under_alpha_at_every_success_rate(rate):
    """Issue 29: equal arms rolled back, and a harm of the margin promoted, each at most alpha of the time
    (95% Clopper-Pearson upper bound over 2,000 windows of 1,200 rollouts, a look after every rollout;
    each evidence on its own, so a promote does not hide a later rollback)."""
    got = calibration(rate, RULE, runs=2000, seed=int(rate * 1000))
    print(f"\n{got.line(RULE.alpha)}")
    assert binomial_upper(got.false_rollbacks, got.runs) <= RULE.alpha
    if got.harmed is not None:
        assert binomial_upper(got.false_promotes, got.runs) <= RULE.alpha


def test_rewards_between_0_and_1_keep_the_guarantee():
    """A reward in [0, 1] that is not 0/1 (a partial score): equal arms of Beta(0.5, 2) rewards."""
    rng = np.random.default_rng(40)
    m, hits = 2000, 0
    for _ in range(m):
        cand = rng.random(1200) < 0.2
        x = rng.beta(0.5, 2.0, 1200)
        hits += bool(np.any(evidence(cand, x, RULE).log_rollback >= math.log(1 / RULE.alpha)))
    print(
        f"\nfalse rollbacks, equal arms of Beta(0.5, 2) rewards: {hits}/{m} (upper {binomial_upper(hits, m):.3f})"
    )
    assert binomial_upper(hits, m) <= RULE.alpha


def block_factor_mean(mu_c: float, mu_s: float, a: float, b: float, m: int) -> float:
    """The exact mean of one block's rollback factor when the rewards' means are (mu_c, mu_s): it is linear
    in each reward, so only the means matter."""
    p0 = (a + m * b) / (1 + m)

    def u(mu: float, p: float) -> float:
        return mu * p / p0 + (1 - mu) * (1 - p) / (1 - p0)

    return u(mu_c, a) * u(mu_s, b) ** m


def test_the_block_factor_has_mean_at_most_one_under_the_whole_null_and_above_one_under_harm():
    grid = np.linspace(0.0, 1.0, 41)
    rng = np.random.default_rng(41)
    worst, best_harm = 0.0, 0.0
    for _ in range(200):
        a, b = sorted(rng.uniform(0.001, 0.999, 2))
        m = int(rng.integers(1, 10))
        for mu_c, mu_s in itertools.product(grid, grid):
            e = block_factor_mean(mu_c, mu_s, a, b, m)
            if mu_c >= mu_s:
                worst = max(worst, e)
            else:
                best_harm = max(best_harm, e)
    assert worst <= 1 + 1e-12  # the candidate no worse: evidence cannot grow on average
    assert best_harm > 1.1  # a worse candidate: it grows


def test_a_harmed_checkpoint_is_rolled_back_within_200_rollouts_at_a_fifth_share():
    """Issue 29's detection target on the demo's scale: trained held-out success ~0.25, a harmed
    checkpoint at ~0 (the loop test's harmed candidate scores 0). Printed beside lower bases and a
    0.05 harm, with the oracle SPRT (both rates known) on the same windows: its p90 is the floor."""
    rows = {}
    for p_s, p_c in ((0.25, 0.0), (0.2, 0.0), (0.1, 0.0), (0.25, 0.05)):
        d = detection(p_s, p_c, RULE, first_decision, runs=2000, seed=int(100 * p_s + 1000 * p_c))
        rows[p_s, p_c] = d
        print(f"\n{d.line()}", end="")
    harm = rows[0.25, 0.0]
    assert harm.share_of(ROLL_BACK) == 1.0
    assert harm.pct(90) <= 200  # measured 141
    # 0.25 -> 0.05: even the oracle's p90 exceeds 200, so no valid test meets 200 at that effect
    assert rows[0.25, 0.05].pct(90, oracle=True) > 200 and rows[0.25, 0.05].share_of(ROLL_BACK) == 1.0


def test_a_better_candidate_is_promoted():
    got = detection(0.25, 0.45, RULE, first_decision, runs=300, seed=2)
    print(f"\nbetter {got.line()}")
    assert got.share_of(PROMOTE) == 1.0


def test_a_fixed_sample_z_test_peeked_every_rollout_would_fail_where_this_holds():
    # why an always-valid test: the same equal-arm streams, peeked with a plain z test at 1.645
    rng = np.random.default_rng(5)
    m, n, false, ours = 300, 1200, 0, 0
    for _ in range(m):
        cand, x = stream(rng, 0.25, 0.25, 0.2, n)
        nc, ns = np.cumsum(cand), np.cumsum(~cand)
        ok = (nc >= 20) & (ns >= 20)
        mc = np.cumsum(np.where(cand, x, 0)) / np.maximum(nc, 1)
        ms = np.cumsum(np.where(~cand, x, 0)) / np.maximum(ns, 1)
        se = np.sqrt(mc * (1 - mc) / np.maximum(nc, 1) + ms * (1 - ms) / np.maximum(ns, 1)) + 1e-12
        false += bool(np.any(ok & ((mc - ms) / se < -1.645)))
        ours += first_decision(cand, x, RULE)[1] == ROLL_BACK
    naive_lower = 1 - binomial_upper(m - false, m, 0.99)  # a 99% lower bound on the naive test's rate
    print(f"\nfalse rollbacks of equal arms, peeked every rollout: z test {false}/{m}, this rule {ours}/{m}")
    assert naive_lower > 2 * RULE.alpha  # peeking breaks the naive test ...
    assert binomial_upper(ours, m) <= 2 * RULE.alpha  # ... not this one


def test_decide_waits_for_the_minimum_then_says_its_numbers():
    rng = np.random.default_rng(9)
    cand, x = stream(rng, 0.25, 0.0, 0.2, 600)
    few = decide(cand[:60], x[:60])
    assert few.action == WAIT and "each arm needs 20" in few.reason
    bad = decide(cand, x)
    assert (
        bad.action == ROLL_BACK
        and bad.e_rollback >= 1 / RULE.alpha
        and "the candidate is worse" in bad.reason
    )
    assert (bad.n_serving, bad.n_candidate) == (int((~cand).sum()), int(cand.sum()))
    assert bad.diff == pytest.approx(x[cand].mean() - x[~cand].mean())
    cand, x = stream(rng, 0.25, 0.6, 0.2, 600)
    good = decide(cand, x)
    assert good.action == PROMOTE and good.e_promote >= 1 / RULE.alpha


def test_all_zero_arms_do_not_claim_certainty():
    # nothing ever succeeds: no evidence either way, however long it runs
    d = decide(np.arange(400) % 5 == 0, np.zeros(400))
    assert d.action == WAIT and d.e_rollback == pytest.approx(1.0)


def test_the_order_is_the_arrival_order_a_look_sees_only_complete_blocks():
    cand = np.array([False] * 4 + [True] + [False] * 3)  # the 2nd block lacks a serving rollout yet
    d = decide(cand, np.zeros(8), CanaryRule(min_per_arm=1))
    assert d.blocks == 1


def test_the_minimum_counts_every_rewarded_rollout_of_the_window_not_only_those_in_blocks():
    # serving's rollouts came first: the blocks use them up after 4 candidates, and the candidate reaches
    # its minimum of 20 only later; the 4 blocks' evidence already says worse, and the look says so
    cand = np.array([False] * 36 + [True] * 4 + [False] * 4 + [True] * 26)
    x = np.where(cand, 0.0, 1.0)
    d = decide(cand, x)
    assert (d.blocks, d.n_candidate, d.action) == (4, 30, ROLL_BACK)
    assert first_decision(cand, x, RULE) == (int(np.flatnonzero(cand)[19]) + 1, ROLL_BACK)


def test_bad_settings_and_rewards_name_the_fix():
    with pytest.raises(ValueError, match="alpha"):
        CanaryRule(alpha=1.5)
    with pytest.raises(ValueError, match="margin"):
        CanaryRule(margin=1.0)
    with pytest.raises(ValueError, match="reward_range"):
        decide(np.array([True, False]), np.array([3.0, 0.5]))
    rng = np.random.default_rng(3)
    cand, x = stream(rng, 0.5, 0.5, 0.2, 400)
    scaled = decide(cand, 5 * x, CanaryRule(reward_range=(0, 5), margin=0.25))
    assert scaled.action == decide(cand, x, CanaryRule(margin=0.05)).action
