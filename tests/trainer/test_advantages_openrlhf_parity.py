"""Our REINFORCE++ equals OpenRLHF 0.11.2's ``--algo.advantage.estimator reinforce`` (REINFORCE++).

The reference is OpenRLHF's own ``RemoteExperienceMaker.compute_advantages_and_returns`` (reward on the
last action token, gamma=1 ``get_cumulative_returns``, then whitening over every action token of the
batch), called unbound on a namespace holding only the settings it reads. Its module imports ``ray``
(not installed: a GPU cluster dependency) and the Ray launcher at import time and uses neither in that
method, so both are stand-ins *during the import only*, removed again so no other test sees a fake
``ray``. As in test_openrlhf_parity.py, the import is strict under CI and skipped on a laptop without it.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from trainer.advantages import RolloutReward, reinforce_plus_plus, rollout_advantages


def _import_experience_maker() -> types.ModuleType:
    fakes = {"ray": types.ModuleType("ray"), "openrlhf.trainer.ray.launcher": types.ModuleType("launcher")}
    fakes["openrlhf.trainer.ray.launcher"].RayActorGroup = object
    sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    added = [name for name in fakes if name not in sys.modules]
    for name in added:
        sys.modules[name] = fakes[name]
    try:
        if os.environ.get("CI"):
            return importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
        pytest.importorskip("openrlhf")
        return importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
    finally:
        for name in added:
            sys.modules.pop(name, None)


em = _import_experience_maker()
Experience = importlib.import_module("openrlhf.trainer.ppo_utils.experience").Experience


def openrlhf_reinforce_pp(rewards: list[float], lengths: list[int], width: int = 9) -> list[torch.Tensor]:
    """OpenRLHF's per-token advantages of one batch: sample i has ``lengths[i]`` action tokens (left of
    the padding) and the scalar reward ``rewards[i]``; one sample per prompt (no group exists)."""
    args = SimpleNamespace(
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="reinforce", gamma=1.0, no_std_norm=False)),
        rollout=SimpleNamespace(n_samples_per_prompt=1),
        reward=SimpleNamespace(clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None),
    )
    maker = SimpleNamespace(
        strategy=SimpleNamespace(args=args),
        args=args,
        advantage_estimator="reinforce",
        kl_ctl=SimpleNamespace(value=0.0),
    )
    maker.get_cumulative_returns = types.MethodType(em.RemoteExperienceMaker.get_cumulative_returns, maker)
    exps = []
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        mask = torch.zeros(1, width, dtype=torch.bool)
        mask[0, :n] = True
        exps.append(
            Experience(
                rewards=torch.tensor([r]), index=[i], action_mask=mask, kl=torch.zeros(1, width), info={}
            )
        )
    out = em.RemoteExperienceMaker.compute_advantages_and_returns(maker, exps)
    return [e.advantages[0, :n] for e, n in zip(out, lengths, strict=True)]


def test_equal_lengths_match_openrlhf_with_one_weight_per_rollout():
    """The trainer's call (every rollout weight 1) is exactly OpenRLHF's when samples are equally long,
    and OpenRLHF's gamma=1 return gives every token of a sample the same advantage."""
    g = torch.Generator().manual_seed(7)
    rewards = (torch.rand(12, generator=g) * 3 - 1).tolist()
    theirs = openrlhf_reinforce_pp(rewards, [5] * 12)
    ours = reinforce_plus_plus(rewards)
    for t, a in zip(theirs, ours, strict=True):
        assert torch.allclose(t, torch.full_like(t, a), atol=1e-5), (t, a)


def test_token_weights_reproduce_openrlhf_whitening_over_tokens():
    """OpenRLHF whitens over action tokens: a long sample weighs more in the mean and variance. Our
    function with each rollout's token count as its weight gives the same numbers; with weight 1 it
    does not (the trainer's choice, documented in ``reinforce_plus_plus``)."""
    rewards, lengths = [1.0, 0.0, 0.0, 0.5, 1.0], [9, 1, 3, 2, 6]
    theirs = [float(t[0]) for t in openrlhf_reinforce_pp(rewards, lengths)]
    assert reinforce_plus_plus(rewards, lengths) == pytest.approx(theirs, abs=1e-5)
    assert reinforce_plus_plus(rewards) != pytest.approx(theirs, abs=1e-3)


def test_binary_rewards_of_distinct_tasks_train_with_openrlhf_numbers():
    """Sixteen distinct tasks, one rollout each (the issue's service): grouping by task would drop all
    sixteen; REINFORCE++ gives each the OpenRLHF advantage and drops none."""
    rewards = [1.0 if i % 3 == 0 else 0.0 for i in range(16)]
    rollouts = [RolloutReward(f"r{i}", f"task-{i}", r, "sql") for i, r in enumerate(rewards)]
    assert rollout_advantages(rollouts, "grpo").advantages == {}
    res = rollout_advantages(rollouts, "reinforce_plus_plus")
    theirs = [float(t[0]) for t in openrlhf_reinforce_pp(rewards, [4] * 16)]
    assert [res.advantages[f"r{i}"] for i in range(16)] == pytest.approx(theirs, abs=1e-5)
    assert (res.n_groups, res.n_groups_dropped_zero_variance, res.n_rollouts_dropped) == (1, 0, 0)
