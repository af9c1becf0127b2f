"""Advantage estimators on hand-computed groups."""

from __future__ import annotations

import math

import pytest

from trainer.advantages import (
    ESTIMATORS,
    EstimatorChoice,
    RolloutReward,
    choose_estimator,
    grpo,
    per_rollout_token_weights,
    reinforce_baseline,
    reinforce_plus_plus,
    rloo,
    rollout_advantages,
)


def test_grpo_centres_on_mean_and_scales_by_sample_std():
    # rewards 1, 0, 0, 1: mean 0.5, sample std sqrt(4*0.25/3) = 0.57735
    adv = grpo([1.0, 0.0, 0.0, 1.0], eps=0.0)
    s = math.sqrt(1.0 / 3.0)
    assert adv == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])


def test_rloo_uses_mean_of_the_other_rollouts():
    # r = 3, 1, 2: baselines (1+2)/2=1.5, (3+2)/2=2.5, (3+1)/2=2
    assert rloo([3.0, 1.0, 2.0]) == pytest.approx([1.5, -1.5, 0.0])


def test_reinforce_baseline_subtracts_group_mean_only():
    assert reinforce_baseline([3.0, 1.0, 2.0]) == pytest.approx([1.0, -1.0, 0.0])


def test_groups_are_tasks_and_zero_variance_groups_are_dropped_and_counted():
    rollouts = [
        RolloutReward("a1", "task-a", 1.0),
        RolloutReward("a2", "task-a", 0.0),
        RolloutReward("b1", "task-b", 0.7),  # all equal: no signal
        RolloutReward("b2", "task-b", 0.7),
        RolloutReward("c1", "task-c", 5.0),  # alone: nothing to compare with
    ]
    res = rollout_advantages(rollouts, "reinforce_baseline")
    assert res.advantages == pytest.approx({"a1": 0.5, "a2": -0.5})
    assert res.n_groups == 3
    assert res.n_groups_dropped_zero_variance == 2
    assert res.n_rollouts_dropped == 3


def test_grpo_group_advantages_do_not_mix_tasks():
    rollouts = [RolloutReward("x1", "x", 10.0), RolloutReward("x2", "x", 20.0),
                RolloutReward("y1", "y", 0.0), RolloutReward("y2", "y", 1.0)]
    res = rollout_advantages(rollouts, "grpo")
    # each group of two: +-0.5*d / (d/sqrt(2)) = +-0.7071, independent of the reward scale
    assert res.advantages["x2"] == pytest.approx(1 / math.sqrt(2), rel=1e-5)
    assert res.advantages["y2"] == pytest.approx(1 / math.sqrt(2), rel=1e-5)
    assert res.advantages["x1"] == pytest.approx(-1 / math.sqrt(2), rel=1e-5)


def test_unknown_estimator_lists_the_valid_ones():
    with pytest.raises(ValueError, match="grpo, rloo, reinforce_baseline"):
        rollout_advantages([], "ppo")


def test_per_rollout_weights_make_each_rollout_count_equally():
    # rollout r1: two calls of 3 and 1 tokens; rollout r2: one call of 2 tokens.
    w = per_rollout_token_weights(["r1", "r1", "r2"], [3, 1, 2])
    assert w == pytest.approx([1 / 8, 1 / 8, 1 / 4])
    # total weight per rollout is 1/2 each, whatever its length
    assert 3 * w[0] + 1 * w[1] == pytest.approx(0.5)
    assert 2 * w[2] == pytest.approx(0.5)


def test_reinforce_plus_plus_whitens_over_the_batch_with_population_std():
    # rewards 1, 0, 0, 1: mean 0.5, population variance 0.25 -> +-1
    assert reinforce_plus_plus([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # token weights 3, 1: mean 0.75, var 3/4*1/16 + 1/4*9/16 = 0.1875
    s = math.sqrt(0.1875)
    assert reinforce_plus_plus([1.0, 0.0], [3, 1]) == pytest.approx([0.25 / s, -0.75 / s])


def test_group_free_keeps_singleton_tasks_and_batches_per_agent():
    rollouts = [
        RolloutReward("a", "t1", 1.0, "planner"), RolloutReward("b", "t2", 0.0, "planner"),
        RolloutReward("c", "t3", 1.0, "coder"), RolloutReward("d", "t4", 1.0, "coder"),  # all equal: dropped
        RolloutReward("e", "t5", 3.0, "lonely"),  # a batch of one: dropped
    ]
    res = rollout_advantages(rollouts, "reinforce_plus_plus")
    assert res.advantages == pytest.approx({"a": 1.0, "b": -1.0})  # each agent whitened on its own
    assert (res.n_groups, res.n_groups_dropped_zero_variance, res.n_rollouts_dropped) == (3, 2, 3)
    assert res.grouped_by == "agent"
    assert rollout_advantages(rollouts, "grpo").grouped_by == "task"


def test_group_free_drops_and_counts_a_zero_variance_batch():
    rollouts = [RolloutReward(f"r{i}", f"t{i}", 0.5) for i in range(5)]
    res = rollout_advantages(rollouts, "reinforce_plus_plus")
    assert res.advantages == {}
    assert (res.n_groups, res.n_groups_dropped_zero_variance, res.n_rollouts_dropped) == (1, 1, 5)


def test_auto_picks_the_group_estimator_only_where_tasks_repeat():
    def batch(sizes):
        return [RolloutReward(f"t{t}-{i}", f"t{t}", float(i)) for t, n in enumerate(sizes) for i in range(n)]

    assert choose_estimator(batch([4, 4, 4])).estimator == "grpo"
    assert choose_estimator(batch([1] * 16)).estimator == "reinforce_plus_plus"
    # half the rollouts share a task: at the threshold, the group estimator
    assert choose_estimator(batch([2, 1, 1])).estimator == "grpo"
    low = choose_estimator(batch([2, 1, 1, 1]))
    assert low.estimator == "reinforce_plus_plus"
    assert low.reason == "auto: 2 of 5 rollouts share their task with another (40% < 50%), 4 tasks"
    assert choose_estimator([]).estimator == "grpo"
    assert choose_estimator(batch([1] * 3), "rloo") == EstimatorChoice("rloo", "set by --estimator")
    with pytest.raises(ValueError, match="auto, grpo, rloo"):
        choose_estimator([], "ppo")


def test_train_flag_choices_come_from_the_registry():
    import dataclasses

    from trainer.config import TrainSettings

    field = next(f for f in dataclasses.fields(TrainSettings) if f.name == "estimator")
    assert field.default == "auto"
    assert list(field.metadata["choices"]) == ["auto", *ESTIMATORS]
    import argparse

    from options import add_options

    parser = argparse.ArgumentParser()
    add_options(parser, TrainSettings)
    assert "reinforce_plus_plus" in parser.format_help()  # the help renders (no stray % in it)
