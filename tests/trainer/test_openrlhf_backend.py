"""The openrlhf backend's batch building, checked on CPU against OpenRLHF's real ``Actor`` and
``PolicyLoss``: the same packed batches give the same logprobs and the same loss as the torch path."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from trainer.dataset import Sample, assign_weights, make_batches, sequence_logprobs
from trainer.loss import LossConfig, policy_loss

sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
pytest.importorskip("openrlhf.models")


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
    from openrlhf.models import Actor
    from transformers import AutoModelForCausalLM

    from trainer.backends.openrlhf import openrlhf_batch, policy_loss_module
    from trainer.config import TrainSettings

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    actor = Actor(model)
    actor.packing_samples = False  # wrapping a loaded model on CPU (ENVIRONMENT.md)
    samples = _samples(tokenizer)
    (batch,) = make_batches(samples, pack_tokens=64)
    ob = openrlhf_batch(batch, tokenizer.pad_token_id)
    assert ob.sequences.shape[0] == len(samples)
    assert int(ob.action_mask.sum()) == sum(len(s.response_ids) for s in samples)

    with torch.no_grad():
        ours = sequence_logprobs(model, batch)
        theirs = actor(ob.sequences, action_mask=ob.action_mask.float(), attention_mask=ob.attention_mask)
    # both enumerate response tokens sample by sample in packing order (row-major)
    torch.testing.assert_close(theirs[ob.action_mask], ours[batch.weights > 0], rtol=1e-4, atol=1e-5)

    # loss: OpenRLHF's PolicyLoss on weight-folded advantages == our weighted policy loss
    settings = TrainSettings(is_correction="clip", is_low=0.5, is_high=2.0, clip_eps_high=0.28)
    shift = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(0)) * 0.3
    new = (theirs + shift) * ob.action_mask
    rollout = torch.where(ob.has_rollout_log_probs, ob.rollout_log_probs, theirs)
    ref_loss, *_ = policy_loss_module(settings)(new, theirs, ob.weighted_advantages(),
                                                action_mask=ob.action_mask.float(), rollout_log_probs=rollout)
    cfg = LossConfig(clip_eps_high=0.28, is_correction="clip", is_threshold_low=0.5, is_threshold_high=2.0)
    out = policy_loss(new, theirs, ob.advantages, ob.weights, cfg, rollout_logprobs=rollout)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)



class FakeDeepspeedStrategy:
    """Stands in for ``openrlhf.utils.deepspeed.DeepspeedStrategy`` (needs CUDA), following the three
    methods the backend calls: ``backward(loss, model, optimizer)``, ``optimizer_step(optimizer, model,
    scheduler)``, ``save_model(model, tokenizer, output_dir)``. Plain AdamW on CPU."""

    def __init__(self, actor, lr: float, weight_decay: float) -> None:
        self.optimizer = torch.optim.AdamW(actor.parameters(), lr=lr, weight_decay=weight_decay)
        self.steps = 0

    def backward(self, loss, model, _optimizer) -> None:
        loss.backward()

    def optimizer_step(self, _optimizer, model, _scheduler) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def save_model(self, model, tokenizer, output_dir: str) -> None:
        model.model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)


def test_openrlhf_training_loop_takes_the_same_step_as_the_torch_backend(tiny_model_dir, tokenizer, tmp_path):
    """Same batches, same settings, one step each: the OpenRLHF loop (Actor + PolicyLoss) and the torch
    backend move the weights identically."""
    from openrlhf.models import Actor
    from transformers import AutoModelForCausalLM

    from trainer.backends.openrlhf import OpenRLHFBackend
    from trainer.backends.torch_backend import TorchBackend
    from trainer.config import TrainSettings

    settings = TrainSettings(model=str(tiny_model_dir), lr=1e-2, max_grad_norm=0.0, progress=False, bf16=False,
                             is_correction="clip", is_low=0.5, is_high=2.0)
    samples = _samples(tokenizer)
    batches = make_batches(samples, pack_tokens=24)  # several micro-batches: accumulation
    assert len(batches) > 1

    torch_backend = TorchBackend.load(settings, tiny_model_dir, None)
    m_torch = torch_backend.train(batches)

    actor = Actor(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    actor.packing_samples = False
    backend = OpenRLHFBackend(actor, FakeDeepspeedStrategy(actor, settings.lr, settings.weight_decay), tokenizer, settings)
    m_orl = backend.train(batches)

    assert m_orl.optimizer_steps == m_torch.optimizer_steps == 1
    assert m_orl.loss == pytest.approx(m_torch.loss, abs=1e-6)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for (name, a), (_, b), (_, w0) in zip(torch_backend.model.named_parameters(), actor.model.named_parameters(),
                                          base.named_parameters(), strict=True):
        # Adam's first step is ~lr * sign(grad): both moved by ~1e-2, and agree to 1% of that
        # (entries whose gradient is ~0 amplify float noise from the different padding layouts)
        assert (a - w0).abs().max() > 0.5 * settings.lr, name
        assert (a - b).abs().max() < 1e-2 * settings.lr, (name, (a - b).abs().max().item())
    backend.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
