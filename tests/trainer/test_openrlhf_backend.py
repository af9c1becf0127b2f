"""The openrlhf backend for real: OpenRLHF's ``Actor`` + ``DeepspeedStrategy`` + ``PolicyLoss`` on DeepSpeed
(CPU accelerator, gloo) in torchrun ranks, checked against the torch backend on the same store.

Nothing is faked. Under ``CI`` a missing or broken OpenRLHF/DeepSpeed install fails these tests instead
of skipping them (a broken import inside the ranks fails the round, hence the test, anyway).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest
import torch

from store.layout import StoreLayout
from trainer.checkpoint import checkpoint_dir, read_manifest
from trainer.dataset import Sample, assign_weights
from trainer.loss import LossConfig, policy_loss
from trainer.packing import make_batches, sequence_logprobs
from trainer.rounds import run_once

_missing = [m for m in ("openrlhf", "deepspeed", "torchdata") if importlib.util.find_spec(m) is None]
if _missing and os.environ.get("CI"):
    raise ImportError(
        f"CI needs the openrlhf extra, missing {_missing}: pip install 'tracerl[openrlhf]' (see Makefile)"
    )
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_missing), reason=f"openrlhf extra not installed ({_missing})")]

# several micro-batches per step, two optimizer steps (the second off-policy: PPO-KL and clipping are
# live), KL to the base model, clipping at max_grad_norm 1; fp32 (the openrlhf backend on CPU trains fp32,
# the torch backend would autocast bf16 on a CPU with bf16 instructions)
FAST = {
    "bf16": False,
    "pack_tokens": 64,
    "max_prompt_tokens": 48,
    "max_response_tokens": 16,
    "steps_per_epoch": 2,
    "kl_coef": 0.05,
    # the same micro-batches in both backends (OpenRLHF takes one sample per row): with 2 steps a
    # round, which samples share a step follows the batching
    "share_prefix": False,
}


def _samples(tokenizer) -> list[Sample]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i, (p, r) in enumerate([(5, 3), (9, 6), (3, 2), (7, 7)]):
        ids = torch.randint(3, len(tokenizer), (p + r,), generator=g).tolist()
        lps = (-torch.rand(r, generator=g) * 2).tolist() if i != 2 else None
        out.append(Sample(f"t{i}", f"r{i // 2}", ids[:p], ids[p:], lps, advantage=[1.0, -0.5, 2.0, -1.5][i]))
    assign_weights(out, "rollout")
    return out


def test_openrlhf_batch_matches_our_packed_batch(tiny_model_dir, tokenizer):
    """In one process: the same packed batch gives the same logprobs through OpenRLHF's ``Actor`` (packed
    samples, sdpa), and ``PolicyLoss`` on weight-folded advantages gives our weighted loss."""
    sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    from openrlhf.models import Actor
    from transformers import AutoModelForCausalLM

    from trainer.backends.openrlhf import openrlhf_batch, policy_loss_module
    from trainer.config import TrainSettings

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.config.use_cache = False
    actor = Actor(model)
    actor.packing_samples = True
    samples = _samples(tokenizer)
    (batch,) = make_batches(samples, pack_tokens=64)
    ob = openrlhf_batch(batch, tokenizer.pad_token_id)
    assert ob.sequences.shape[0] == len(samples)
    n_tok = int(ob.action_mask.sum())
    assert n_tok == sum(len(s.response_ids) for s in samples)

    with torch.no_grad():
        expected = sequence_logprobs(ours, batch)
        theirs = actor(ob.sequences, action_mask=ob.action_mask, attention_mask=ob.attention_mask)
    # both enumerate response tokens sample by sample in packing order (row-major)
    torch.testing.assert_close(theirs[ob.action_mask], expected[batch.weights > 0], rtol=1e-4, atol=1e-5)

    settings = TrainSettings(is_correction="clip", is_low=0.5, is_high=2.0, clip_eps_high=0.28)
    shift = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(0)) * 0.3
    new = (theirs + shift) * ob.action_mask
    rollout = torch.where(ob.has_rollout_log_probs, ob.rollout_log_probs, theirs)
    total_w = float(ob.weights.sum())
    for world in (1, 2):  # dp_size undoes DeepSpeed's mean over ranks: the loss is world times ours
        ref_loss, *_ = policy_loss_module(settings)(
            new,
            theirs,
            ob.folded_advantages(total_w, n_tok),
            action_mask=ob.action_mask.float(),
            rollout_log_probs=rollout,
            dp_size=world,
            batch_num_tokens=n_tok,
        )
        cfg = LossConfig(
            clip_eps_high=0.28, is_correction="clip", is_threshold_low=0.5, is_threshold_high=2.0
        )
        out = policy_loss(new, theirs, ob.advantages, ob.weights / total_w, cfg, rollout_logprobs=rollout)
        torch.testing.assert_close(out.loss * world, ref_loss, rtol=1e-5, atol=1e-6)


def _assert_same_checkpoint(torch_ckpt, orl_ckpt, lr: float) -> None:
    """Entry by entry: every weight within 1% of one Adam step (lr) of the torch backend's, the Adam
    moments to float noise; loss, grad norm and PPO-KL within 1e-3 (relative)."""
    from safetensors.torch import load_file

    name = (
        "adapter_model.safetensors" if (torch_ckpt / "adapter_config.json").exists() else "model.safetensors"
    )
    w_torch, w_orl = load_file(str(torch_ckpt / name)), load_file(str(orl_ckpt / name))
    assert w_torch.keys() == w_orl.keys()
    for k in w_torch:
        torch.testing.assert_close(
            w_orl[k], w_torch[k], rtol=0, atol=1e-2 * lr, msg=lambda m, k=k: f"{k}: {m}"
        )
    o_torch, o_orl = (torch.load(c / "optimizer.pt", weights_only=True) for c in (torch_ckpt, orl_ckpt))
    assert o_torch["state"].keys() == o_orl["state"].keys()
    for i, st in o_torch["state"].items():
        assert float(o_orl["state"][i]["step"]) == float(st["step"])
        torch.testing.assert_close(o_orl["state"][i]["exp_avg"], st["exp_avg"], rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(o_orl["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-3, atol=1e-10)
    m_torch, m_orl = (read_manifest(c)["metrics"] for c in (torch_ckpt, orl_ckpt))
    for key in ("micro_batches", "tokens", "optimizer_steps"):
        assert m_orl[key] == m_torch[key], key
    for key in ("loss", "policy_loss", "kl", "grad_norm", "ppo_kl", "clip_fraction", "is_filtered_fraction"):
        assert m_orl[key] == pytest.approx(m_torch[key], rel=1e-3, abs=1e-6), (key, m_orl[key], m_torch[key])


def _train_both(tmp_path, write_rows, make_rollouts, train_settings, rounds: int, **kw) -> list[tuple]:
    stores = {b: tmp_path / b for b in ("torch", "openrlhf")}
    pairs = []
    for k in range(rounds):
        rows = make_rollouts(k)
        for backend, store in stores.items():
            write_rows(store, rows)
            out = run_once(train_settings(store, backend=backend, **{**FAST, **kw}), log=lambda m: None)
            assert out.status == "trained", (backend, out.message)
        pairs.append(tuple(checkpoint_dir(StoreLayout.at(s).checkpoints, k + 1) for s in stores.values()))
    return pairs


def test_two_openrlhf_rounds_in_two_ranks_match_the_torch_backend(
    tmp_path, write_rows, make_rollouts, train_settings, tiny_model_dir
):
    """``tracerl train --once --backend openrlhf --nproc 2`` (ZeRO-2, fp32, CPU ranks over gloo) twice,
    the second round starting from the first one's weights and Adam state, against the torch backend
    in one process on the same data."""
    from safetensors.torch import load_file

    pairs = _train_both(tmp_path, write_rows, make_rollouts, train_settings, rounds=2, nproc=2)
    lr = train_settings(tmp_path).lr
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = load_file(str(pairs[0][1] / "model.safetensors"))
    assert max(float((moved[k] - base[k]).abs().max()) for k in base) > 0.5 * lr  # not vacuous: it trained
    for torch_ckpt, orl_ckpt in pairs:
        _assert_same_checkpoint(torch_ckpt, orl_ckpt, lr)
        manifest = read_manifest(orl_ckpt)
        assert manifest["backend"] == "openrlhf" and manifest["settings"]["nproc"] == 2
        assert manifest["metrics"]["grad_norm"] > 0 and manifest["metrics"]["ppo_kl"] != 0


def test_two_openrlhf_lora_rounds_in_one_rank_match_the_torch_backend(
    tmp_path, write_rows, make_rollouts, train_settings
):
    """``--nproc 1`` still trains in a torchrun rank (DeepSpeed's state never enters this process); with
    LoRA: the adapter and its Adam state, then a round that starts from that adapter."""
    pairs = _train_both(
        tmp_path, write_rows, make_rollouts, train_settings, rounds=2, nproc=1, lora_rank=4, lr=1e-2
    )
    for torch_ckpt, orl_ckpt in pairs:
        assert (orl_ckpt / "adapter_config.json").exists() and read_manifest(orl_ckpt)["adapter"]
        assert not (orl_ckpt / "model.safetensors").exists()
        _assert_same_checkpoint(torch_ckpt, orl_ckpt, lr=1e-2)
