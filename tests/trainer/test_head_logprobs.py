"""Chunked, checkpointed LM-head logprobs (``trainer/head_logprobs.py``) equal the model's own forward:
values and gradients, full weights and LoRA, packed rows with shared prefixes, chunks that split the
batch unevenly; and a model that transforms its logits is scored through its own forward."""

from __future__ import annotations

import pytest
import torch

import trainer.packing as packing
from trainer.head_logprobs import (
    CHUNK_TOKENS,
    CPU_CHUNK_BYTES,
    MIN_CHUNK_TOKENS,
    chunk_tokens_for,
    head_logprobs,
    split_head,
)
from trainer.packing import make_batches, sequence_logprobs

from .test_packing import _mixed

pytestmark = pytest.mark.slow  # builds models (make test-fast skips it)


def _loss_and_grads(model, batches, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = sum((sequence_logprobs(model, b, b.weights > 0, **kw) * b.advantages * b.weights).sum() for b in batches)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _forward_path(monkeypatch, model, batches):
    with monkeypatch.context() as m:
        m.setattr(packing, "split_head", lambda _model: None)  # the model's own forward, today's other path
        return _loss_and_grads(model, batches)


@pytest.mark.parametrize("lora", [False, True])
def test_chunked_head_equals_the_models_forward_in_value_and_gradient(tiny_model_dir, tokenizer, monkeypatch, lora):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert split_head(model) is not None
    batches = make_batches(_mixed(tokenizer), 48, tokenizer.pad_token_id, share_prefix=True)
    assert any(b.shares_prefixes for b in batches)
    n_scored = int(sum((b.weights > 0).sum() for b in batches))
    ref_loss, ref_grads = _forward_path(monkeypatch, model, batches)
    for chunk in (3, 7, n_scored + 1):  # uneven chunks, and one chunk holding everything
        loss, grads = _loss_and_grads(model, batches, chunk_tokens=chunk)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-9)  # logprobs are reduced in fp32
        assert grads.keys() == ref_grads.keys() and len(grads) > (4 if lora else 5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-8, msg=name)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())


def test_the_backward_pass_recomputes_a_chunk_instead_of_keeping_its_logits():
    """Saved for backward: the hidden states, not the [N, vocab] logits."""
    head = torch.nn.Linear(16, 5000, bias=False)
    hidden = torch.randn(64, 16, requires_grad=True)
    ids = torch.randint(0, 5000, (64,))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = head_logprobs(head, hidden, ids, chunk_tokens=16)
    assert lp.shape == (64,) and bool((lp <= 0).all())
    assert saved and max(saved) < 16 * 5000  # no chunk's logits were kept
    lp.sum().backward()
    plain = torch.log_softmax(head(hidden.detach()), -1).gather(-1, ids[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, plain)
    assert hidden.grad is not None and head.weight.grad is not None


def test_a_cpu_chunk_keeps_its_logits_under_the_heap_limit_and_a_gpu_keeps_1024():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert chunk_tokens_for(cpu, 49_152) == 128  # SmolLM2: 128 x 49k fp32 logits = 24 MiB
    assert chunk_tokens_for(cpu, 152_064) == 41  # Qwen2.5
    assert chunk_tokens_for(cpu, 5_000_000) == MIN_CHUNK_TOKENS
    assert chunk_tokens_for(cpu, 100) == CHUNK_TOKENS  # a tiny vocabulary: the cap
    assert chunk_tokens_for(cuda, 152_064) == CHUNK_TOKENS
    for vocab in (49_152, 152_064, 32_000):
        assert chunk_tokens_for(cpu, vocab) * vocab * 4 <= CPU_CHUNK_BYTES


def test_the_default_chunk_follows_the_device_and_the_heads_vocabulary(monkeypatch):
    """No ``chunk_tokens``: the head runs on ``chunk_tokens_for``'s chunks (a smaller byte budget here, so a
    small head splits), and the values equal one chunk holding everything."""
    import trainer.head_logprobs as hl

    monkeypatch.setattr(hl, "CPU_CHUNK_BYTES", 20 * 5000 * 4)  # 20 tokens of a 5,000-word head
    head = torch.nn.Linear(16, 5000, bias=False)
    rows: list[int] = []
    head.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    hidden, ids = torch.randn(64, 16), torch.randint(0, 5000, (64,))
    with torch.no_grad():
        lp = head_logprobs(head, hidden, ids)
        whole = head_logprobs(head, hidden, ids, chunk_tokens=64)
    assert rows == [20, 20, 20, 4, 64]
    torch.testing.assert_close(lp, whole)


def test_a_model_that_transforms_its_logits_is_scored_by_its_own_forward(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.config.final_logit_softcapping = 30.0  # Gemma 2's: logits = 30 * tanh(logits / 30), outside the head
    assert split_head(model) is None
    batch = make_batches(_mixed(tokenizer), 48, tokenizer.pad_token_id)[0]
    with torch.no_grad():
        lp = sequence_logprobs(model, batch, batch.weights > 0)
    assert bool((lp[batch.weights > 0] < 0).all())
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        head_logprobs(torch.nn.Linear(2, 3), torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), chunk_tokens=0)


def _saved_and_grads(model, batches) -> tuple[int, dict[str, torch.Tensor]]:
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = sum((sequence_logprobs(model, b, b.weights > 0) * b.advantages * b.weights).sum() for b in batches)
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_keeps_less_and_gives_the_same_gradients(tiny_model_dir, tokenizer):
    """``--activation-checkpointing`` on a LoRA model (frozen embeddings: the non-reentrant form needs no
    input that requires grad), through the backend's own switch."""
    from trainer.backends.policy_model import load_policy
    from trainer.backends.torch_backend import checkpoint_activations
    from trainer.config import TrainSettings

    settings = TrainSettings(lora_rank=4)
    batches = make_batches(_mixed(tokenizer), 48, tokenizer.pad_token_id, share_prefix=True)
    runs = []
    for on in (False, True):
        model, _ = load_policy(settings, tiny_model_dir, None, dtype=torch.float64)
        if on:
            checkpoint_activations(model)
        model.train()
        runs.append(_saved_and_grads(model, batches))
    (kept_off, grads_off), (kept_on, grads_on) = runs
    assert kept_on < 0.7 * kept_off, (kept_on, kept_off)
    assert grads_on.keys() == grads_off.keys() and grads_off
    for name, g in grads_off.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-7, atol=1e-10, msg=name)


@pytest.mark.parametrize(
    "attention,whole", [("dense", True), ("varlen", True), ("varlen", False)], ids=["dense-layers", "varlen-layers", "varlen-parts"]
)
def test_compiled_blocks_give_the_same_loss_and_gradients(tiny_model_dir, tokenizer, attention, whole):
    """``--compile-blocks``: whole decoder layers (or, as under activation checkpointing, their norms, MLPs
    and attention modules) run as torch.compile graphs (inductor, dynamic shapes); values and gradients
    match eager to float precision, and batches of other row lengths and packed layouts reuse the graphs
    (a layout dynamo guarded on would re-trace every batch: ``trainer.attention.SegmentLayout``)."""
    from torch._dynamo.utils import counters

    from trainer.attention import use_attention
    from trainer.backends.policy_model import load_policy
    from trainer.backends.torch_backend import compile_blocks
    from trainer.config import TrainSettings

    torch._dynamo.reset()
    batches = make_batches(_mixed(tokenizer), 48, tokenizer.pad_token_id, share_prefix=True)
    others = make_batches(_mixed(tokenizer)[2:], 40, tokenizer.pad_token_id, share_prefix=True)
    assert len({b.input_ids.shape[-1] for b in batches + others}) > 2  # rows of more than one length
    runs = []
    for on in (False, True):
        model, _ = load_policy(TrainSettings(), tiny_model_dir, None, dtype=torch.float32)
        use_attention(model, attention)
        layers = model.config.num_hidden_layers
        if on:
            assert compile_blocks(model, whole_layers=whole) == (layers + 1 if whole else 4 * layers + 1)
        model.train()
        runs.append(_loss_and_grads(model, batches))
        if on:
            graphs = counters["stats"]["unique_graphs"]
            _loss_and_grads(model, others)
            assert counters["stats"]["unique_graphs"] == graphs, "another layout re-traced a compiled block"
    (loss_off, grads_off), (loss_on, grads_on) = runs
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-6)
    assert grads_on.keys() == grads_off.keys() and grads_off
    for name, g in grads_off.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()
