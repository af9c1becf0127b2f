"""PPO-clip loss, importance correction and KL estimators on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import (
    ImportanceStats,
    LossConfig,
    approx_kl,
    importance_weights,
    policy_loss,
    ppo_clip_token_loss,
    token_weights,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_ratio_inside_the_clip_range_gives_the_plain_surrogate():
    loss, clipped = ppo_clip_token_loss(t([math.log(1.1)]), t([0.0]), t([2.0]))
    assert loss.item() == pytest.approx(-2.2, rel=1e-6)
    assert not clipped.any()


def test_positive_advantage_clips_at_one_plus_eps_high():
    # ratio 1.5, eps_high 0.28: min(1.5*1, 1.28*1) = 1.28 -> loss -1.28
    loss, clipped = ppo_clip_token_loss(t([math.log(1.5)]), t([0.0]), t([1.0]), clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28, rel=1e-6)
    assert clipped.all()


def test_negative_advantage_clips_at_one_minus_eps_low():
    # ratio 0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8
    loss, _ = ppo_clip_token_loss(t([math.log(0.5)]), t([0.0]), t([-1.0]), clip_eps_low=0.2)
    assert loss.item() == pytest.approx(0.8, rel=1e-6)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # ratio 10, A=-1: min(-10, -1.2) = -10; dual clip 3: max(-10, -3) = -3 -> loss 3
    loss, _ = ppo_clip_token_loss(t([math.log(10.0)]), t([0.0]), t([-1.0]), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0, rel=1e-6)


def test_truncated_importance_weights():
    old = t([0.0, 0.0, 0.0])
    rollout = t([math.log(0.5), math.log(4.0), math.log(0.01)])  # ratios 2, 0.25, 100
    w, filtered = importance_weights(old, rollout, "clip", 0.5, 5.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.5, 5.0])
    assert filtered.flatten().tolist() == [False, True, True]
    w, _ = importance_weights(old, rollout, "mask", 0.5, 5.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.0, 0.0])


def test_kl_estimators():
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])  # log r = log 2
    lr = math.log(2.0)
    assert approx_kl(logp, ref, "k1").item() == pytest.approx(lr)
    assert approx_kl(logp, ref, "k2").item() == pytest.approx(lr**2 / 2)
    assert approx_kl(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + lr)


def test_token_and_sequence_weights():
    mask = t([1, 1, 1, 0], [1, 0, 0, 0])
    assert token_weights(mask, "token").flatten().tolist() == pytest.approx([0.25, 0.25, 0.25, 0, 0.25, 0, 0, 0])
    assert token_weights(mask, "sequence").flatten().tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 6, 0, 0.5, 0, 0, 0])


def test_policy_loss_weighted_sum_and_kl_term():
    logp = t([0.0, 0.0], [0.0, 0.0])
    adv = t([1.0, 1.0], [-2.0, 0.0])
    w = t([0.25, 0.25], [0.5, 0.0])
    ref = t([math.log(0.5), 0.0], [0.0, 0.0])
    out = policy_loss(logp, logp, adv, w, LossConfig(kl_coef=0.1, kl_estimator="k1"), ref_logprobs=ref)
    # policy: -(0.25*1 + 0.25*1 + 0.5*-2) = 0.5; kl: 0.25*log 2
    assert out.policy_loss.item() == pytest.approx(0.5)
    assert out.kl.item() == pytest.approx(0.25 * math.log(2.0), rel=1e-6)
    assert out.loss.item() == pytest.approx(0.5 + 0.1 * 0.25 * math.log(2.0), rel=1e-6)


def test_gradient_of_on_policy_loss_is_the_policy_gradient():
    # At ratio 1 the gradient w.r.t. logp is -w*A: raising logp of positive-advantage tokens lowers the loss.
    logp = torch.zeros(1, 3, requires_grad=True)
    adv = t([1.0, -1.0, 0.5])
    w = t([0.5, 0.25, 0.25])
    out = policy_loss(logp, logp.detach(), adv, w, LossConfig())
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.5, 0.25, -0.125])


def test_stale_calls_decoupled_ppo_with_truncated_importance_weights_by_hand():
    """Asynchronous rounds: pi_theta is clipped against pi_old (the policy at the start of the round)
    and each token's loss is scaled by the truncated weight pi_old / pi_behaviour (the engine's logprob
    of an older version): AReaL's decoupled objective with TIS truncation to [0.5, 5]."""
    logp = torch.log(t([0.55, 0.225, 0.5, 0.9])).requires_grad_(True)  # pi_theta after some steps
    old = torch.log(t([0.5, 0.25, 0.5, 0.3]))  # pi_old: the round's start
    behaviour = torch.log(t([0.25, 0.4, 0.01, 0.3]))  # the engine's logprobs when the call was sampled
    adv = t([1.0, -1.0, 2.0, 1.0])
    w = t([0.25, 0.25, 0.25, 0.25])
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, is_correction="clip", is_threshold_low=0.5,
                     is_threshold_high=5.0)
    out = policy_loss(logp, old, adv, w, cfg, rollout_logprobs=behaviour)
    # per token: ratio r = pi/pi_old, surrogate -min(r A, clip(r, 0.8, 1.2) A), weight clamp(pi_old/pi_b)
    #   1: r 1.1, A  1 -> -1.1 ; weight 2             -> -2.2
    #   2: r 0.9, A -1 ->  0.9 ; weight 0.625         ->  0.5625
    #   3: r 1.0, A  2 -> -2.0 ; weight 50, cut to 5  -> -10.0   (filtered: outside [0.5, 5])
    #   4: r 3.0, A  1 -> -1.2 ; weight 1             -> -1.2    (clipped)
    assert out.policy_loss.item() == pytest.approx(0.25 * (-2.2 + 0.5625 - 10.0 - 1.2), rel=1e-5)
    assert out.clip_fraction.item() == pytest.approx(0.25)
    assert out.is_filtered_fraction.item() == pytest.approx(0.25)
    out.loss.backward()
    # d/dlogp of -w*iw*r*A is -w*iw*r*A where the unclipped branch is taken, 0 where the clipped one is
    assert logp.grad.flatten().tolist() == pytest.approx(
        [-0.25 * 2 * 1.1, 0.25 * 0.625 * 0.9, -0.25 * 5 * 2.0, 0.0], rel=1e-5)
    mask_cfg = LossConfig(is_correction="mask", is_threshold_low=0.5, is_threshold_high=5.0)
    masked = policy_loss(logp.detach(), old, adv, w, mask_cfg, rollout_logprobs=behaviour)
    assert masked.policy_loss.item() == pytest.approx(0.25 * (-2.2 + 0.5625 + 0.0 - 1.2), rel=1e-5)


def test_importance_stats_over_scored_response_tokens_only():
    stats = ImportanceStats()
    old = torch.log(t([0.5, 0.5], [0.2, 0.9]))
    behaviour = torch.log(t([0.25, 0.5], [0.4, 0.1]))
    scored = torch.tensor([[True, True], [True, False]])  # the last token has no engine logprob
    stats.add(old, behaviour, scored)
    assert stats.tokens == 3
    assert stats.weight_sum == pytest.approx(2.0 + 1.0 + 0.5)
    assert (stats.weight_min, stats.weight_max) == pytest.approx((0.5, 2.0))
    stats.add(old, behaviour, torch.zeros_like(scored))  # nothing scored: nothing changes
    assert stats.tokens == 3
