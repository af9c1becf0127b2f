"""Our loss equals OpenRLHF 0.11.2's ``PolicyLoss`` / ``compute_approx_kl`` on random batches.

`make install` (so CI) installs openrlhf without its GPU-only dependencies; under CI (``CI`` set)
the import is strict so a broken install fails the run, elsewhere ``importorskip`` spares a laptop. flash-attn's CUDA extension cannot be built on
CPU, so, as OpenRLHF's own CPU tests do, an empty ``flash_attn_2_cuda`` module is registered
before import (nothing in the loss path calls into it).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest
import torch

from trainer.loss import LossConfig, approx_kl, policy_loss, token_weights

sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
_import = importlib.import_module if os.environ.get("CI") else pytest.importorskip
openrlhf_models = _import("openrlhf.models")
openrlhf_utils = _import("openrlhf.models.utils")


def _batch(seed: int, rows: int = 4, cols: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 3
    logp = old + torch.randn(rows, cols, generator=g) * 0.4  # ratios well outside [0.8, 1.2] too
    rollout = old + torch.randn(rows, cols, generator=g) * 0.8
    adv = torch.randn(rows, 1, generator=g).expand(rows, cols).clone()
    mask = (torch.rand(rows, cols, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    mask[-1] = 0.0  # a fully masked row: sequence mode must skip it
    mask[-1, 2] = 1.0
    return logp, old, rollout, adv, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("eps_low", "eps_high", "dual_clip"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_ppo_clip_matches_openrlhf_policy_loss(level, eps_low, eps_high, dual_clip):
    logp, old, _, adv, mask = _batch(seed=int(eps_high * 100) + 1000 * (level == "token"))
    ref_loss_fn = openrlhf_models.PolicyLoss(
        clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip=dual_clip, token_level_loss=level == "token"
    )
    lp_ref = logp.clone().requires_grad_(True)
    ref_loss, ref_clip, ref_ppo_kl, _, _ = ref_loss_fn(lp_ref, old, adv, action_mask=mask)
    ref_loss.backward()

    lp_ours = logp.clone().requires_grad_(True)
    cfg = LossConfig(clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip=dual_clip, is_correction="off")
    out = policy_loss(lp_ours, old, adv, token_weights(mask, level), cfg)
    out.loss.backward()

    torch.testing.assert_close(out.loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.clip_fraction, ref_clip, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.ppo_kl, ref_ppo_kl, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_importance_correction_matches_openrlhf_token_level_tis(mode):
    logp, old, rollout, adv, mask = _batch(seed=7)
    ref_loss_fn = openrlhf_models.PolicyLoss(
        is_correction_level="token", is_correction_mode=mode, is_correction_gating="ratio",
        is_correction_threshold=(0.5, 2.0),
    )
    lp_ref = logp.clone().requires_grad_(True)
    ref_loss, _, _, _, ref_filtered = ref_loss_fn(lp_ref, old, adv, action_mask=mask, rollout_log_probs=rollout)
    ref_loss.backward()

    lp_ours = logp.clone().requires_grad_(True)
    cfg = LossConfig(is_correction=mode, is_threshold_low=0.5, is_threshold_high=2.0)
    out = policy_loss(lp_ours, old, adv, token_weights(mask, "token"), cfg, rollout_logprobs=rollout)
    out.loss.backward()

    assert 0.0 < ref_filtered.item() < 1.0  # the batch exercises the thresholds
    torch.testing.assert_close(out.loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.is_filtered_fraction, ref_filtered, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_openrlhf_compute_approx_kl(estimator):
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 9, generator=g) * 4
    ref = logp + torch.randn(3, 9, generator=g) * 3  # includes |log r| > 10 to hit the clamps
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    ours = approx_kl(a, ref, estimator)
    theirs = openrlhf_utils.compute_approx_kl(b, ref, kl_estimator=estimator)
    torch.testing.assert_close(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
