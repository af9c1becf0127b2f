"""The canary decision on simulated reward streams (seeded), checked after every rollout."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loop.canary import PROMOTE, ROLL_BACK, WAIT, ArmStats, CanaryRule, decide, first_decision

RULE = CanaryRule()


def stream(rng: np.random.Generator, p_serving: float, p_candidate: float, share: float, n: int):
    cand = rng.random(n) < share
    rewards = (rng.random(n) < np.where(cand, p_candidate, p_serving)).astype(float)
    return cand, rewards


def runs(seed: int, p_s: float, p_c: float, share: float = 0.2, n: int = 1200, m: int = 300):
    rng = np.random.default_rng(seed)
    return [first_decision(*stream(rng, p_s, p_c, share, n), RULE) for _ in range(m)]


def binomial_ceiling(m: int, p: float, z: float = 3.0) -> float:
    """The most events of probability ``p`` in ``m`` trials, at z standard deviations above the mean."""
    return m * p + z * math.sqrt(m * p * (1 - p))


def test_harmed_candidate_is_rolled_back_and_detection_is_fast_at_a_fifth_share():
    # the demo's scale: success 0.25 -> 0.05, candidate share 0.2
    got = runs(1, 0.25, 0.05)
    assert all(a == ROLL_BACK for _, a in got)
    needed = np.array([n for n, _ in got])
    print(
        f"\nrollouts to roll back a 0.25 -> 0.05 harm at share 0.2: median {np.median(needed):.0f}, "
        f"p90 {np.percentile(needed, 90):.0f}, max {needed.max()}"
    )
    assert np.median(needed) <= 200


def test_better_candidate_is_promoted():
    got = runs(2, 0.25, 0.45)
    assert all(a == PROMOTE for _, a in got)


def test_equal_arms_are_rolled_back_at_most_alpha_of_the_time_despite_a_look_after_every_rollout():
    m = 400
    got = runs(3, 0.25, 0.25, m=m)
    rollbacks = sum(a == ROLL_BACK for _, a in got)
    print(f"\nfalse rollbacks of a candidate equal to serving (0.25, share 0.2, a look after every rollout): "
          f"{rollbacks}/{m} = {rollbacks / m:.3f} (alpha {RULE.alpha})")  # fmt: skip
    assert rollbacks <= binomial_ceiling(m, RULE.alpha), rollbacks
    # and a harm beyond the margin is promoted at most alpha of the time
    harmed = runs(4, 0.25, 0.25 - RULE.margin, m=m)
    assert sum(a == PROMOTE for _, a in harmed) <= binomial_ceiling(m, RULE.alpha)


def test_a_fixed_sample_z_test_peeked_every_rollout_would_fail_where_this_holds():
    # why an always-valid test: the same equal-arm streams, peeked with a plain z test at 1.645
    rng = np.random.default_rng(5)
    m, n, false = 200, 1200, 0
    for _ in range(m):
        cand, x = stream(rng, 0.25, 0.25, 0.2, n)
        nc, ns = np.cumsum(cand), np.cumsum(~cand)
        ok = (nc >= 20) & (ns >= 20)
        mc = np.cumsum(np.where(cand, x, 0)) / np.maximum(nc, 1)
        ms = np.cumsum(np.where(~cand, x, 0)) / np.maximum(ns, 1)
        se = np.sqrt(mc * (1 - mc) / np.maximum(nc, 1) + ms * (1 - ms) / np.maximum(ns, 1)) + 1e-12
        false += bool(np.any(ok & ((mc - ms) / se < -1.645)))
    assert false > binomial_ceiling(m, RULE.alpha)  # peeking breaks the naive test ...
    assert sum(a == ROLL_BACK for _, a in runs(6, 0.25, 0.25, m=m)) <= binomial_ceiling(m, RULE.alpha)


def test_decide_waits_for_the_minimum_then_says_its_numbers():
    few = decide(ArmStats.of([0.0] * 19), ArmStats.of([1.0] * 50))
    assert few.action == WAIT and "each arm needs 20" in few.reason
    bad = decide(ArmStats.of([1, 0, 0, 0] * 40), ArmStats.of([0.0] * 40))
    assert bad.action == ROLL_BACK and bad.upper < 0 and bad.diff == pytest.approx(-0.25)
    assert (bad.n_serving, bad.n_candidate) == (160, 40)
    good = decide(ArmStats.of([1, 0, 0, 0] * 40), ArmStats.of([1, 0] * 40))
    assert good.action == PROMOTE and good.lower > -RULE.margin


def test_all_zero_arms_do_not_claim_certainty():
    # a raw sample variance of 0 would make any difference look certain; the shrunk one does not
    d = decide(ArmStats.of([0.0] * 20), ArmStats.of([0.0] * 19 + [1.0]))
    assert d.action == WAIT


def test_bad_settings_and_rewards_name_the_fix():
    with pytest.raises(ValueError, match="alpha"):
        CanaryRule(alpha=1.5)
    with pytest.raises(ValueError, match="reward_range"):
        decide(ArmStats(30, 3.0, 1.0), ArmStats(30, 0.5, 0.1))
    assert decide(ArmStats(30, 3.0, 1.0), ArmStats(30, 3.1, 1.0), CanaryRule(reward_range=(0, 5))).action in (
        PROMOTE,
        WAIT,
    )


def test_betting_rule_against_the_default_over_a_thousand_streams():
    """Issue 29's detection target, with the test that trusts only the reward bounds (loop/canary_betting.py)
    beside the default mSPRT on the same 1,000 streams; the default is kept because it is faster."""
    from loop.canary_betting import betting_first_decision

    m = 1000
    rows = {}
    for name, p_c, seed in (
        ("harmed 0.25->0.05", 0.05, 11),
        ("equal 0.25", 0.25, 12),
        ("better 0.25->0.45", 0.45, 13),
    ):
        rng = np.random.default_rng(seed)
        streams = [stream(rng, 0.25, p_c, 0.2, 1200) for _ in range(m)]
        for rule_name, fn in (
            ("msprt", lambda c, x: first_decision(c, x, RULE)),
            ("betting", lambda c, x: betting_first_decision(c, x, 0.2, RULE)),
        ):
            got = [fn(c, x) for c, x in streams]
            n = np.array([k for k, _ in got])
            acts = [a for _, a in got]
            rows[rule_name, name] = (n, acts)
            print(
                f"\n{rule_name:8s} {name:18s} p50 {np.median(n):5.0f} p90 {np.percentile(n, 90):5.0f} "
                f"rollbacks {acts.count(ROLL_BACK) / m:.3f} promotes {acts.count(PROMOTE) / m:.3f}",
                end="",
            )
    n, acts = rows["betting", "harmed 0.25->0.05"]
    assert acts.count(ROLL_BACK) >= 0.99 * m
    assert np.median(n) <= 250  # slower than the mSPRT (median ~124), measured ~180
    _, acts = rows["betting", "equal 0.25"]
    assert acts.count(ROLL_BACK) <= binomial_ceiling(m, RULE.alpha)  # valid at every look, not asymptotically
    _, acts = rows["betting", "better 0.25->0.45"]
    assert acts.count(PROMOTE) >= 0.99 * m
    # the default stays: it is faster on the harm (both p50 and p90) at a false-rollback rate within alpha
    msprt_n, _ = rows["msprt", "harmed 0.25->0.05"]
    assert np.percentile(msprt_n, 90) < np.percentile(rows["betting", "harmed 0.25->0.05"][0], 90)


@pytest.mark.parametrize("rate", [0.05, 0.1])
def test_at_low_success_rates_only_the_betting_rule_keeps_false_rollbacks_within_alpha(rate):
    """Equal arms at a low success rate: the mSPRT's plug-in variance is at its least trustworthy there
    (measured 0.062 at 0.05 and 0.085 at 0.1 over these streams: above alpha); the betting rule's
    guarantee needs no variance estimate. Printed for both, asserted for the betting rule."""
    from loop.canary_betting import betting_first_decision

    m = 1000
    rng = np.random.default_rng(21)
    streams = [stream(rng, rate, rate, 0.2, 1200) for _ in range(m)]
    msprt = sum(first_decision(c, x, RULE)[1] == ROLL_BACK for c, x in streams)
    betting = sum(betting_first_decision(c, x, 0.2, RULE)[1] == ROLL_BACK for c, x in streams)
    print(
        f"\nfalse rollbacks, equal arms at {rate}: msprt {msprt / m:.3f}, betting {betting / m:.3f} (alpha {RULE.alpha})"
    )
    assert betting <= binomial_ceiling(m, RULE.alpha)
